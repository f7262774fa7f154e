"""Where a benchmark level's CPU time went, thread by thread (Linux `/proc/self/task`): at sixteen streams
on the H200 the LLM step's host work was larger than its GPU call (sixteenth run: 4.1 ms a step against
2.8), and that host work waits for the interpreter lock whenever other threads run Python. The CPU
seconds of each named thread over a level say which of them do: the graph threads, the LLM batcher, the
prefill pool, the requests' own threads (those that ended during the level are `ended or unnamed`: the
process's CPU time less the threads still there). A process near one core of CPU over the level's wall
time is bound by the lock, not by the GPU. The whole machine's busy cores over the level (/proc/stat) say
what else ran beside it."""

from __future__ import annotations

import os
import re
import resource
import threading
from collections.abc import Mapping
from pathlib import Path

_POOL_SUFFIX = re.compile(r"[-_ ]?\d+(_\d+)?$")  # ThreadPoolExecutor-0_3, Thread-12 (worker): one group
ENDED = "ended or unnamed"


def thread_cpu_s(task_dir: Path = Path("/proc/self/task")) -> dict[int, float]:
    """CPU seconds of each live thread of this process, by native thread id: the scheduler's
    nanoseconds on a CPU (`schedstat`) where the kernel keeps them, else user + system clock ticks
    (`stat`, 10 ms apart); empty where /proc is not there."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    try:
        tasks = list(task_dir.iterdir())
    except OSError:
        return {}
    for task in tasks:
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
            continue
        except (OSError, ValueError, IndexError):
            pass
        try:
            stat = (task / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3 of stat(5)
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime: fields 14 and 15
    return out


def host_cpu_s(stat: Path = Path("/proc/stat")) -> tuple[float, float] | None:
    """The whole machine's CPU seconds since boot, busy (user, nice, system, irq, softirq, steal) and
    waiting for I/O (iowait), from the `cpu` line of /proc/stat (proc(5), in clock ticks); None where it is
    not there. Over a level, the busy seconds beyond the process's own are the rest of the machine's work:
    other processes and the kernel's (page-cache writeback after the device setup wrote its graphs)."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    try:
        user, nice, system, _idle, iowait, irq, softirq, steal = ([int(v) for v in fields[1:9]] + [0] * 8)[:8]
    except ValueError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq + steal) / ticks, iowait / ticks


def process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def group(name: str) -> str:
    """A thread's name without its pool or counter suffix, so a pool's threads count together."""
    base = name.split(" (")[0]
    return _POOL_SUFFIX.sub("", base) or base


class ThreadCpu:
    """A snapshot of the process's and its threads' CPU time; `since(earlier)` the CPU ms of each
    thread group between the two, `ENDED` for what threads that are gone took."""

    def __init__(self) -> None:
        self.names = {t.native_id: group(t.name) for t in threading.enumerate() if t.native_id is not None}
        self.threads = thread_cpu_s()
        self.process = process_cpu_s()
        self.host = host_cpu_s()

    def since(self, earlier: ThreadCpu) -> dict[str, float]:
        groups: dict[str, float] = {}
        named = 0.0
        for tid, cpu in self.threads.items():
            spent = cpu - earlier.threads.get(tid, 0.0)
            name = self.names.get(tid) or earlier.names.get(tid)
            if name is None or spent <= 0:
                continue
            groups[name] = groups.get(name, 0.0) + spent
            named += spent
        groups[ENDED] = max(0.0, (self.process - earlier.process) - named)
        return {name: round(s * 1e3, 1) for name, s in sorted(groups.items(), key=lambda kv: -kv[1]) if s > 0}


def level_cpu(before: ThreadCpu, after: ThreadCpu, wall_s: float) -> Mapping[str, object]:
    """A level's CPU: the process's ms, its share of one core over the level, the ms by thread group; and
    the whole machine's busy and I/O-waiting cores over the level (`host_cores_busy` less `cores_busy`:
    what else ran beside the level), where /proc/stat is there."""
    total = after.process - before.process
    out: dict[str, object] = {"process_cpu_ms": round(total * 1e3, 1),
                              "cores_busy": round(total / wall_s, 2) if wall_s > 0 else 0.0,
                              "thread_cpu_ms": after.since(before)}
    if before.host is not None and after.host is not None and wall_s > 0:
        out["host_cores_busy"] = round((after.host[0] - before.host[0]) / wall_s, 2)
        out["host_iowait_cores"] = round((after.host[1] - before.host[1]) / wall_s, 2)
    return out
