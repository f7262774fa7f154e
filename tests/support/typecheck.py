"""mypy over the installed names. The folders keep their short names
(`daemon/`, `models/`, ...) while Python imports them as `cosyedge_*`
(pyproject's package-dir), and mypy cannot follow setuptools' editable
finder, so it checks a farm of links `build/typecheck/cosyedge_* -> folder`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"cosyedge_daemon": "daemon", "cosyedge_models": "models", "cosyedge_build": "edge_build",
            "cosyedge_cloud": "cloud_bridge"}


def link_farm() -> Path:
    farm = ROOT / "build" / "typecheck"
    farm.mkdir(parents=True, exist_ok=True)
    for name, folder in PACKAGES.items():
        link = farm / name
        target = ROOT / folder
        if link.is_symlink() and Path(os.readlink(link)) == target:
            continue
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target, target_is_directory=True)
    return farm


def run_mypy(targets: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    """mypy on the four packages (or on `targets`, dotted module names)."""
    farm = link_farm()
    args = [a for t in (targets or PACKAGES) for a in (("-m", t) if targets else ("-p", t))]
    env = {**os.environ, "MYPYPATH": str(farm)}
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=ROOT, env=env, capture_output=True, text=True)
