"""TensorRT for the tests that run the `trt` path: the real one where it is importable (a GPU
machine with TensorRT and pycuda; skipped with the reason when it cannot run there), else the
emulator (tests/support/trt_emulator), so the whole `trt` path runs in the default test run.
`trt_runtime` holds it for a test module (import it into the module or a conftest);
`build_trt_bundle` builds a bundle's engines inside it with `cosyedge build engines`."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.components import not_here
from tests.support.trt_emulator import Emulation, emulated_tensorrt, real_tensorrt_present


@pytest.fixture(scope="module")
def trt_runtime() -> Iterator[Emulation | None]:
    """The module's TensorRT: None for a real one, else the emulation (TensorRT 10.13, an Orin)."""
    if real_tensorrt_present():
        from tests.models.conftest import trt_unavailable_reason

        reason = trt_unavailable_reason()
        if reason:
            not_here(f"a real TensorRT is installed but cannot run here: {reason}")
        yield None
        return
    with emulated_tensorrt("10.13") as emu:
        yield emu


def build_trt_bundle(source: Path, dst: Path) -> Path:
    """A copy of `source` with its engines built (fp32) by `cosyedge build engines`."""
    from cosyedge_build.tensorrt.engines import EngineBuildSettings, build_engines

    shutil.copytree(source, dst)
    build_engines(dst, EngineBuildSettings(workspace_mib=512))
    return dst
