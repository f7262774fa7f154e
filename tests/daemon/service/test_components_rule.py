"""The one rule for components that .ci/setup installs: skip locally, fail in CI."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.components import not_here, require_binary, require_cuda_provider, require_data, require_module

ROOT = Path(__file__).resolve().parents[3]


def test_missing_component_skips_locally_and_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no-such-tool-x is not installed"):
        require_binary("no-such-tool-x", "apt-get install x")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        require_binary("no-such-tool-x", "apt-get install x")
    assert require_binary("sh", "-").endswith("/sh")


def test_missing_module_or_data_skips_locally_and_fails_in_ci(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no_such_module_x cannot be imported"):
        require_module("no_such_module_x")
    with pytest.raises(pytest.skip.Exception, match="the recordings is not installed"):
        require_data(None, "the recordings")
    with pytest.raises(pytest.skip.Exception, match="the recordings is not installed"):
        require_data(tmp_path / "absent", "the recordings")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        require_module("no_such_module_x")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        require_data(None, "the recordings")
    assert require_module("json").dumps([1]) == "[1]"
    assert require_data(tmp_path, "-") == tmp_path


def test_what_ci_lacks_by_design_skips_locally_and_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    """not_here (a GPU, the CUDA provider, a real TensorRT where the emulator is checked): the same rule, so a
    green CI run has run every test it collected."""
    import onnxruntime as ort

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])  # CI's onnxruntime
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="a real TensorRT"):
        not_here("a real TensorRT is importable here")
    with pytest.raises(pytest.skip.Exception, match="no CUDAExecutionProvider"):
        require_cuda_provider()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        not_here("a real TensorRT is importable here")
    with pytest.raises(pytest.fail.Exception, match="no CUDAExecutionProvider.*CI=true"):
        require_cuda_provider()


def test_triton_setup_fails_loudly_in_ci_where_it_would_skip(tmp_path: Path) -> None:
    """A Python without libpython: locally the hook skips (exit 0), with CI=true it fails."""
    fake = tmp_path / "python3"
    fake.write_text('#!/bin/sh\ncase "$*" in *Py_ENABLE_SHARED*) echo 0;; *) exec python3 "$@";; esac\n')
    fake.chmod(0o755)
    hook = ROOT / ".ci" / "setup.d" / "triton.sh"
    local = subprocess.run(["bash", str(hook)], env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake)},
                           capture_output=True, text=True, timeout=60)
    ci = subprocess.run(["bash", str(hook)], env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "CI": "true"},
                        capture_output=True, text=True, timeout=60)
    assert local.returncode == 0 and "skipping" in local.stderr
    assert ci.returncode == 1 and "ERROR (CI=true)" in ci.stderr
