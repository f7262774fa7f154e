"""ruff and mypy run as part of the test suite, so CI runs them with the
README's test command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.typecheck import run_mypy

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_clean() -> None:
    result = _run("ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_clean() -> None:
    result = run_mypy()
    assert result.returncode == 0, result.stdout + result.stderr
