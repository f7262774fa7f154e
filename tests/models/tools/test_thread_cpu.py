"""A level's CPU time by thread (models/tools/thread_cpu.py): a busy named thread's CPU is counted under
its name, a pool's threads under one group, and a thread that ended during the level under ENDED."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cosyedge_models.tools.thread_cpu import ENDED, ThreadCpu, group, host_cpu_s, level_cpu, thread_cpu_s


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        sum(range(1000))


@pytest.mark.parametrize(("name", "grouped"), [
    ("ThreadPoolExecutor-0_3", "ThreadPoolExecutor"), ("llm-prefill_2", "llm-prefill"),
    ("Thread-12 (worker)", "Thread"), ("cosyedge-cuda-graphs", "cosyedge-cuda-graphs"),
    ("bench-request-7", "bench-request"), ("cosyedge-flow-graphs", "cosyedge-flow-graphs"),
])
def test_a_pools_threads_count_as_one_group(name: str, grouped: str) -> None:
    assert group(name) == grouped


def test_cpu_is_counted_by_thread_name_and_what_ended_apart() -> None:
    release = threading.Event()

    def busy_then_wait() -> None:
        _spin(0.3)
        release.wait()

    live = threading.Thread(target=busy_then_wait, name="measured-live")
    gone = threading.Thread(target=_spin, args=(0.2,), name="measured-gone")
    before = ThreadCpu()
    t0 = time.perf_counter()
    live.start()
    gone.start()
    gone.join()
    while live.is_alive() and ThreadCpu().since(before).get("measured-live", 0.0) < 250:
        time.sleep(0.02)
    after = ThreadCpu()
    release.set()
    live.join()
    cpu = level_cpu(before, after, time.perf_counter() - t0)
    by_thread = cpu["thread_cpu_ms"]
    assert isinstance(by_thread, dict)
    assert by_thread["measured-live"] >= 250  # its 0.3 s of spinning, in clock ticks
    assert "measured-gone" not in by_thread and by_thread[ENDED] >= 150  # it ended before the snapshot
    assert float(cpu["process_cpu_ms"]) >= by_thread["measured-live"] + 150  # type: ignore[arg-type]


def test_without_schedstat_the_clock_ticks_of_stat_count(tmp_path: Path) -> None:
    """A kernel without schedstat: user + system ticks (fields 14 and 15 of stat(5)); a comm with
    spaces and parentheses does not shift them."""
    task = tmp_path / "4242"
    task.mkdir()
    after_comm = ["S", *["0"] * 10, "150", "50", *["0"] * 30]  # state, fields 4-13, utime, stime, ...
    (task / "stat").write_text("4242 (odd (name) x) " + " ".join(after_comm) + "\n")
    ticks = os.sysconf("SC_CLK_TCK")
    assert thread_cpu_s(tmp_path) == {4242: 200 / ticks}
    assert thread_cpu_s(tmp_path / "missing") == {}


def test_the_machines_cpu_comes_from_the_cpu_line_of_proc_stat(tmp_path: Path) -> None:
    """Busy: user, nice, system, irq, softirq, steal; iowait apart; idle in neither (proc(5))."""
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 20 30 5000 40 5 6 7 0 0\ncpu0 50 10 15 2500 20 2 3 3 0 0\n")
    ticks = os.sysconf("SC_CLK_TCK")
    assert host_cpu_s(stat) == ((100 + 20 + 30 + 5 + 6 + 7) / ticks, 40 / ticks)
    stat.write_text("intr 1 2 3\n")
    assert host_cpu_s(stat) is None
    assert host_cpu_s(tmp_path / "missing") is None


def test_a_level_counts_the_machines_busy_cores_beside_its_own() -> None:
    """A second process spinning beside the level is in the machine's busy cores, not in the level's."""
    before = ThreadCpu()
    t0 = time.perf_counter()
    with subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.4\n"
                           "while time.process_time() < end: pass"]) as other:
        assert other.wait(timeout=60) == 0
    wall = time.perf_counter() - t0
    cpu = level_cpu(before, ThreadCpu(), wall)
    host_busy, own = float(cpu["host_cores_busy"]), float(cpu["cores_busy"])  # type: ignore[arg-type]
    assert host_busy * wall >= own * wall + 0.3  # the other process's 0.4 s, in clock ticks
    assert float(cpu["host_iowait_cores"]) >= 0  # type: ignore[arg-type]
