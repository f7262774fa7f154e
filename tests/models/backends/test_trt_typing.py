"""mypy over the TensorRT and CUDA modules against tensorrt-stubs
10.13.0.35.1 (TensorRT 10.13 = JetPack 7.0; the modules use only API that
TensorRT 10.3 of JetPack 6.2 also has).

The repo-wide mypy run (tests/static) cannot see the stubs: the package has
no py.typed marker and five of its signatures do not parse, so every
TensorRT name would silently be Any. Here the stubs are repaired into a temp
dir (tests/support/trt_stubs.py) and put on MYPYPATH, with the repo's own
mypy settings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.components import missing
from tests.support.trt_stubs import installed_stub_root, patched_stubs
from tests.support.typecheck import link_farm

ROOT = Path(__file__).resolve().parents[3]
# By module name, over the link farm of tests/support/typecheck.py, so their own imports resolve.
MODULES = ("cosyedge_models.backends.tensorrt.backend", "cosyedge_models.backends.tensorrt.session",
           "cosyedge_models.backends.tensorrt.decode",
           "cosyedge_models.backends.tensorrt.flow_cache", "cosyedge_models.backends.tensorrt.graph",
           "cosyedge_models.backends.tensorrt.static_flow", "cosyedge_models.backends.tensorrt.static_vocoder",
           "cosyedge_models.backends.tensorrt.static_encoder",
           "cosyedge_models.backends.fixed_shapes", "cosyedge_models.backends.cuda",
           "cosyedge_models.backends.gpu_probe", "cosyedge_build.tensorrt.engines",
           "cosyedge_build.tensorrt.engine_plan")


def _config(tmp: Path, stubs: Path) -> Path:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    repo = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    lines = ["[mypy]", f"mypy_path = {stubs}:{link_farm()}"]
    for key in ("python_version", "ignore_missing_imports", "check_untyped_defs", "warn_unused_ignores"):
        if key in repo:
            lines.append(f"{key} = {repo[key]}")
    # Errors inside the third-party stubs themselves are not ours to fix.
    lines += ["", "[mypy-tensorrt,tensorrt.*,tensorrt_bindings,tensorrt_bindings.*]", "ignore_errors = True"]
    path = tmp / "mypy.ini"
    path.write_text("\n".join(lines) + "\n")
    return path


def _mypy(config: Path, *files: str) -> subprocess.CompletedProcess[str]:
    cache = ROOT / ".cache" / "mypy-trt"
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(config), "--cache-dir", str(cache),
                           *files], cwd=ROOT, capture_output=True, text=True)


@pytest.fixture(scope="module")
def stub_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if installed_stub_root() is None:
        missing("tensorrt-stubs is not installed (pip install --no-deps -r .ci/requirements-nodeps.txt)")
    tmp = tmp_path_factory.mktemp("trtstubs")
    return _config(tmp, patched_stubs(tmp / "stubs"))


def test_stubs_are_in_effect(stub_config: Path, tmp_path: Path) -> None:
    """A misuse of the TensorRT API must be an error, else the check is vacuous."""
    probe = tmp_path / "probe.py"
    probe.write_text("import tensorrt as trt\n\n\ndef f(e: trt.ICudaEngine) -> None:\n"
                     "    e.execute_async_v3(0)\n    e.get_tensor_name('x')\n")
    result = _mypy(stub_config, str(probe))
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert '"ICudaEngine" has no attribute "execute_async_v3"' in out
    assert 'Argument 1 to "get_tensor_name" of "ICudaEngine" has incompatible type "str"' in out


def test_trt_modules_typecheck_against_stubs(stub_config: Path) -> None:
    result = _mypy(stub_config, *(a for m in MODULES for a in ("-m", m)))
    assert result.returncode == 0, result.stdout + result.stderr
