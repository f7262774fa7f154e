"""edge_build/tools/device_run.sh, the one GPU script, checked where no GPU is:
it parses, its import names resolve through the link farm it makes (the GPU
machine has no install), and it runs every gpu-marked test file there is."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "edge_build" / "tools" / "device_run.sh"


def _line(pattern: str) -> str:
    for line in SCRIPT.read_text().splitlines():
        if re.search(pattern, line):
            return line
    raise AssertionError(f"no line matching {pattern!r} in {SCRIPT}")


def test_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True).returncode == 0


def test_every_gpu_marked_test_file_is_run() -> None:
    found = subprocess.run(["bash", "-c", _line(r"^all_gpu_tests=") + '; echo "$all_gpu_tests"'], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    marked = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                    if "pytest.mark.gpu" in p.read_text())
    assert marked and found == marked


def test_link_farm_gives_the_import_names(tmp_path: Path) -> None:
    farm = _line(r"for pair in cosyedge_daemon").replace("/tmp/src", str(tmp_path))
    body = _line(r'ln -sfn "\$PWD').replace("/tmp/src", str(tmp_path))
    subprocess.run(["bash", "-c", f"{farm}\n{body}\ndone"], cwd=ROOT, check=True)
    code = ("import cosyedge_daemon.cli.main as d, cosyedge_models, cosyedge_build, cosyedge_cloud; "
            "print(d.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}).stdout
    assert out.strip() == f"{tmp_path}/cosyedge_daemon/cli/main.py"


def test_the_default_plans_bench_flags_are_the_bench_commands() -> None:
    """Every bench and batch step of device_plan.sh's default plan parses as the `cosyedge bench` it
    runs (a flag that does not exist would cost a lease's step)."""
    from cosyedge_daemon.cli.main import build_parser

    plan_script = ROOT / "edge_build" / "tools" / "device_plan.sh"
    plan_lines = re.compile(r"\s*((voice|stage|goals)=|plan=\$\{PLAN)")
    lines = [line for line in plan_script.read_text().splitlines() if plan_lines.match(line)]
    plan = subprocess.run(["bash", "-c", "\n".join(lines) + '\necho "$plan"'], capture_output=True, text=True,
                          check=True).stdout.strip()
    steps = 0
    for entry in plan.split(";"):
        words = entry.split()
        if words[1] not in ("bench", "batch"):
            continue
        env = dict(w.split("=", 1) for w in words[2:])
        extra = env.get("BENCH_ARGS", "").replace("+", " ").split()
        fixed = ["--graph-batching", "--batching", "16", "--graph-flow-batch", "--concurrency-only"] \
            if words[1] == "batch" else []
        args = build_parser().parse_args(["bench", "--bundle", "b", "--backend", "ort-cuda", *fixed, *extra])
        assert args.bundle == "b"
        steps += 1
    assert steps >= 4


def test_a_wait_on_a_fresh_machine_ends_at_once(tmp_path: Path) -> None:
    """`device_plan.sh wait` where no plan was started (the plan's machine was released and a fresh one
    answered) exits 3 at once instead of spending the lease's budget on an idle GPU."""
    plan_script = ROOT / "edge_build" / "tools" / "device_plan.sh"
    done = subprocess.run(["bash", str(plan_script), "wait", "60"], cwd=ROOT, capture_output=True, text=True,
                          env={"PLAN_DIR": str(tmp_path / "r"), "PATH": "/usr/bin:/bin"}, timeout=20)
    assert done.returncode == 3
    assert "no plan on this machine" in done.stderr


def _run_plan(tmp_path: Path, plan: str, steps: str = "") -> Path:
    """Starts `device_plan.sh` on a fake runner (each step writes its JSON; the step `fail` exits 1) and
    waits for the plan's end; returns the plan's folder."""
    tree = tmp_path / "tree"
    tree.mkdir()
    runner = tree / "runner.sh"
    runner.write_text('#!/bin/sh\nmkdir -p "$1" && echo "{}" > "$1/$(basename "$1").json"\n[ "$2" != fail ]\n')
    runner.chmod(0o755)
    res = tmp_path / "r"
    env = {"PLAN_DIR": str(res), "PLAN_REPO": str(tmp_path / "repo"), "PLAN_RUNNER": "./runner.sh",
           "PLAN": plan, "STEPS": steps, "TESTS_BESIDE": "", "PATH": "/usr/bin:/bin"}
    plan_script = ROOT / "edge_build" / "tools" / "device_plan.sh"
    subprocess.run(["bash", str(plan_script), "start"], cwd=tree, env=env, check=True, timeout=20,
                   capture_output=True)
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run(["bash", str(plan_script), "wait", "20"], cwd=tree, env={**env, "OUT": str(out)}, check=True,
                   timeout=40, capture_output=True)
    return res


def test_a_fallback_entry_runs_only_after_a_failed_one(tmp_path: Path) -> None:
    """`!dir` entries run only where the entry before them failed: the goals' bench again with one weight
    copy a session costs nothing where the shared copy worked."""
    res = _run_plan(tmp_path, "a ok;!b ok;c fail;!d ok")
    status = (res / "status").read_text()
    assert "skip b" in status and "start b" not in status
    assert "end c rc=1" in status and "end d rc=0" in status
    assert not (res / "b").exists() and (res / "d" / "d.json").exists()
    assert sorted(p.name for p in (tmp_path / "out").glob("*.json")) == ["a.json", "c.json", "d.json"]


def test_a_wait_cut_short_keeps_the_steps_that_ended(tmp_path: Path) -> None:
    """A `wait` call killed by the lease's limit still leaves the JSONs of the steps that had ended in $OUT
    (they are copied as each step ends, not only when the wait returns)."""
    res = tmp_path / "r"
    res.mkdir()
    (res / "plan").write_text("a batch")
    (res / "a").mkdir()
    (res / "a" / "batch_one.json").write_text("{}")
    os.utime(res / "plan", (1, 1))
    (res / "status").write_text("10:00:00 start a batch\n10:00:09 end a rc=0\n10:00:09 start b batch\n")
    out = tmp_path / "out"
    out.mkdir()
    plan_script = ROOT / "edge_build" / "tools" / "device_plan.sh"
    waiting = subprocess.Popen(["bash", str(plan_script), "wait", "120"], cwd=ROOT, stdout=subprocess.DEVNULL,
                               env={"PLAN_DIR": str(res), "OUT": str(out), "PATH": "/usr/bin:/bin"})
    try:
        deadline = time.monotonic() + 20
        while not (out / "batch_one.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert waiting.poll() is None  # the plan has not ended: the wait still runs
    finally:
        waiting.kill()
        waiting.wait()
    assert (out / "batch_one.json").read_text() == "{}"
    assert (out / "logs.tgz").stat().st_size > 0
    with tarfile.open(out / "results.tgz") as results:  # every step's JSON, whatever the files' count limit
        assert results.getnames() == ["a/batch_one.json"]


def test_steps_pick_and_order_the_plans_entries(tmp_path: Path) -> None:
    """STEPS keeps the named entries of the plan in the order given (a short lease runs what matters
    first), a fallback entry by its name without the `!`."""
    res = _run_plan(tmp_path, "a ok;b fail;!f ok;c ok", steps="c b f")
    starts = [line.split()[2] for line in (res / "status").read_text().splitlines() if " start " in line]
    assert starts == ["c", "b", "f"]
    assert not (res / "a").exists()
