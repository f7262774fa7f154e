"""The runtime dependencies resolve, as binary wheels from the package index,
for the boards the README names: aarch64 (manylinux_2_28/2_17) on Python 3.10
(JetPack 6) and 3.12 (JetPack 7). A pin that drops a board (a release without
a cp310 aarch64 wheel, say) fails here with pip's own message.

pip evaluates the markers of the requirements it is given, and of their
dependencies, against the interpreter that runs it, not the target
(--python-version changes only which wheels are acceptable). So the top-level
markers are evaluated here for the target, and the dependencies a resolved
package declares for the target but pip left out (async-timeout on 3.10, say)
are resolved in a second, small pass."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support.components import missing

ROOT = Path(__file__).resolve().parents[2]
PLATFORMS = ("manylinux_2_28_aarch64", "manylinux_2_17_aarch64", "manylinux2014_aarch64")
# The README's Jetson extras that are built on the board against its CUDA, so
# they come from the index as a source archive, never a wheel.
BUILT_ON_BOARD = {"pycuda"}
NETWORK_ERRORS = ("NewConnectionError", "Network is unreachable", "Temporary failure in name resolution",
                  "Max retries exceeded", "ConnectTimeoutError")


def _target_env(python: str) -> dict[str, str]:
    return {"python_version": python, "python_full_version": f"{python}.0", "platform_machine": "aarch64",
            "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def _pyproject() -> dict:  # type: ignore[type-arg]
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def jetson_extras() -> list[str]:
    """The extras the README's Jetson section tells users to install."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## On a Jetson", 1)[1].split("\n## ", 1)[0]
    return sorted(set(re.findall(r"cosyedge\[([a-z0-9_,-]+)\]", section)))


def requirements_for(python: str) -> tuple[list[Requirement], list[Requirement]]:
    """(wheels, source-only) requirements a Jetson install asks for on `python`."""
    project = _pyproject()["project"]
    lines = list(project["dependencies"])
    for extra in jetson_extras():
        for name in extra.split(","):
            lines += project["optional-dependencies"][name]
    env = _target_env(python)
    reqs = [Requirement(line) for line in lines]
    picked = [r for r in reqs if r.marker is None or r.marker.evaluate(env)]
    for r in picked:
        r.marker = None
    wheels = [r for r in picked if canonicalize_name(r.name) not in BUILT_ON_BOARD]
    sources = [r for r in picked if canonicalize_name(r.name) in BUILT_ON_BOARD]
    return wheels, sources


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=600)


def _fail(proc: subprocess.CompletedProcess[str], what: str) -> None:
    message = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines()
                        if not line.startswith("WARNING: Location"))
    if any(e in message for e in NETWORK_ERRORS):
        missing(f"the package index is not reachable: {message[-300:]}")
    pytest.fail(f"{what} does not resolve:\n{message}")


def _missing_for_target(report: dict, python: str) -> list[Requirement]:  # type: ignore[type-arg]
    """Dependencies the resolved packages declare for the target that pip left out."""
    got = {canonicalize_name(item["metadata"]["name"]): item for item in report["install"]}
    missing: dict[str, Requirement] = {}
    for item in report["install"]:
        extras = set(item.get("requested_extras") or ())
        for line in item["metadata"].get("requires_dist", []):
            req = Requirement(line)
            if req.marker is not None and not any(
                    Marker(str(req.marker)).evaluate({**_target_env(python), "extra": e}) for e in extras | {""}):
                continue
            name = canonicalize_name(req.name)
            if name not in got and name not in missing:
                req.marker = None
                missing[name] = req
    return list(missing.values())


def resolve_wheels(reqs: list[Requirement], python: str, tmp: Path) -> dict:  # type: ignore[type-arg]
    """pip's report of the install; a later pass resolves only what the
    earlier ones left out, with what they chose as constraints."""
    platform_args = [a for p in PLATFORMS for a in ("--platform", p)]
    installed: list[dict] = []  # type: ignore[type-arg]
    constraints = tmp / "constraints.txt"
    constraints.write_text("")
    todo = reqs
    for attempt in range(4):
        report = tmp / f"report-{attempt}.json"
        proc = _pip("install", "--dry-run", "--ignore-installed", "--only-binary=:all:", *platform_args,
                    "--python-version", python, "--implementation", "cp", "--target", str(tmp / "target"),
                    "--report", str(report), "-c", str(constraints), "-q", *map(str, todo))
        if proc.returncode != 0:
            _fail(proc, f"the runtime dependencies for aarch64 Python {python} ({', '.join(map(str, todo))})")
        installed += json.loads(report.read_text())["install"]
        todo = _missing_for_target({"install": installed}, python)
        if not todo:
            return {"install": installed}
        constraints.write_text("".join(f"{i['metadata']['name']}=={i['metadata']['version']}\n" for i in installed))
    pytest.fail(f"dependencies kept appearing for Python {python}: {todo}")


@pytest.mark.parametrize("python", ["3.10", "3.12"])
def test_runtime_dependencies_resolve_for_aarch64(python: str, tmp_path: Path) -> None:
    wheels, _ = requirements_for(python)
    report = resolve_wheels(wheels, python, tmp_path)
    got = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
    for req in wheels:  # every pin resolved to itself, as a wheel for the board
        assert req.specifier.contains(got[canonicalize_name(req.name)]), (req, got)
    for item in report["install"]:
        url = item["download_info"]["url"]
        assert url.endswith(".whl") and ("aarch64" in url or url.endswith("-none-any.whl")), url


def test_board_built_extras_have_their_source_release() -> None:
    _, sources = requirements_for("3.10")
    assert {canonicalize_name(r.name) for r in sources} == BUILT_ON_BOARD, "README's Jetson extras changed"
    for req in sources:
        proc = _pip("index", "versions", req.name)
        if proc.returncode != 0:
            _fail(proc, str(req))
        (pinned,) = [str(s.version) for s in req.specifier]
        assert pinned in re.split(r"[,\s]+", proc.stdout), f"{req} is not on the index: {proc.stdout}"


def test_markers_pick_one_pin_per_python() -> None:
    for python in ("3.10", "3.12"):
        wheels, _ = requirements_for(python)
        names = [canonicalize_name(r.name) for r in wheels]
        assert len(names) == len(set(names)), f"two pins of one package for Python {python}: {names}"
