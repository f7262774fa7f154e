"""One rule for tests that need a component which `.ci/setup` installs
(binaries: mosquitto, tritonserver, espeak-ng, systemd-analyze, jackd;
Python modules: torch, the upstream CosyVoice modules, tensorrt-stubs, the
Hermes test package; data: the auditok speech recordings): locally a missing
component skips the test with the reason and the fix; in CI (environment
CI=true) it fails the test, so a broken setup can never turn the run green
by skipping. Tests use require_binary, require_module and require_data,
never pytest.importorskip or a skipif on a component (tests/static checks).
What CI lacks by design (a GPU, the CUDA provider, TensorRT) or must not have
(a real TensorRT or torchaudio where a test checks the stand-in) goes through
not_here (require_cuda_provider): the same skip locally, a failure under CI=true."""

from __future__ import annotations

import importlib
import os
import shutil
from pathlib import Path
from typing import Any, NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def missing(what: str) -> NoReturn:
    """Skip (locally) or fail (CI=true) because `what` (a sentence saying
    what is missing and how to install it) is not there."""
    if in_ci():
        pytest.fail(f"{what} -- CI=true: .ci/setup must provide it, so this fails instead of skipping",
                    pytrace=False)
    pytest.skip(what, allow_module_level=True)


def not_here(what: str) -> NoReturn:
    """Skip (locally) or fail (CI=true) because what a test needs by design is not on this machine (a GPU,
    onnxruntime's CUDA provider, a TensorRT that runs), or a real component stands where the test checks the
    project's stand-in for it (a real TensorRT or torchaudio; CI installs neither): a run under CI=true
    runs every test it collects or fails."""
    if in_ci():
        pytest.fail(f"{what} -- CI=true: every collected test must run, so this fails instead of skipping",
                    pytrace=False)
    pytest.skip(what, allow_module_level=True)


def require_cuda_provider() -> None:
    """onnxruntime's CUDA provider (the `-m gpu` tests; a GPU run installs onnxruntime-gpu), else not_here()."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        not_here(f"onnxruntime has no CUDAExecutionProvider here (available: {ort.get_available_providers()}); "
                 "a -m gpu run needs onnxruntime-gpu on a GPU")


def require_binary(name: str, install: str) -> str:
    """The path of executable `name`, else missing() with `install` (e.g. 'apt-get install mosquitto')."""
    path = shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/usr/local/sbin/{name}") if os.access(p, os.X_OK)), None
    )
    if path is None:
        missing(f"{name} is not installed ({install}; .ci/setup installs it)")
    return path


SETUP = "pip install -e '.[build,cloud,dev]' and .ci/requirements-nodeps.txt"


def require_module(name: str, install: str = SETUP) -> Any:
    """The imported module `name`, else missing() with `install`."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing(f"Python module {name} cannot be imported ({exc}); {install}; .ci/setup installs it")


def require_data(path: Path | None, what: str) -> Path:
    """`path` when the data is there (a finder returns None when not), else missing(`what`)."""
    if path is None or not path.exists():
        missing(f"{what} is not installed; .ci/setup installs it")
    return path
