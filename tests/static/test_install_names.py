"""Every importable name cosyedge installs starts with `cosyedge`, so it can
be installed beside python-daemon (import name `daemon`) and beside an
application's own `models` package, in a fresh virtual environment."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*cmd: str | Path, cwd: Path | None = None) -> str:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheels")
    # our wheel, built from this checkout with the build backend pyproject pins
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", out, ROOT)
    # python-daemon, as released (the registry, or pip's cache)
    _run(sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", out, "python-daemon==3.1.2")
    # an application's own top-level `models` package
    app = tmp_path_factory.mktemp("app")
    (app / "models").mkdir()
    (app / "models" / "__init__.py").write_text('OWNER = "the application"\n')
    (app / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools"]\nbuild-backend = '
                                        '"setuptools.build_meta"\n[project]\nname = "app-models"\nversion = "1"\n'
                                        '[tool.setuptools]\npackages = ["models"]\n')
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", out, app)
    return out


def test_wheel_installs_only_cosyedge_names(wheels: Path) -> None:
    (wheel,) = wheels.glob("cosyedge-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.startswith("cosyedge")} == set(), tops


def test_beside_python_daemon_and_an_app_models_package(wheels: Path, tmp_path: Path) -> None:
    env = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=True).create(env)
    py = env / "bin" / "python"
    _run(py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *sorted(wheels.glob("*.whl")))
    out = _run(py, "-c", (
        "import daemon, models, cosyedge_daemon.cli.main as cli; "
        "print(daemon.DaemonContext.__module__, models.OWNER, cli.main.__module__)"), cwd=tmp_path)
    assert out.split() == ["daemon.daemon", "the", "application", "cosyedge_daemon.cli.main"]
