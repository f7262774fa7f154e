"""`build engines`' defects of issue 22 under the TensorRT emulator:

6. each deserialized engine (only read for its activation memory) is released before the next
   stage builds: on an 8 GB board the engines and the builder share the DRAM;
8. a timing cache from another device is reported and replaced, not silently ignored by
   set_timing_cache(ignore_mismatch=False) and written back unchanged."""

from __future__ import annotations

import gc
import logging
import shutil
import weakref
from pathlib import Path
from typing import Any

import pytest
from cosyedge_build.tensorrt.engines import TIMING_CACHE, EngineBuildSettings, build_engines

from tests.support.components import not_here
from tests.support.trt_emulator import JETSON_ORIN_NANO, RTX_4090, Emulation, emulated_tensorrt, real_tensorrt_present
from tests.support.trt_emulator import plan as planfmt


def _copy(bundle: Path, tmp_path: Path) -> Path:
    root = tmp_path / "bundle"
    shutil.copytree(bundle, root)
    return root


def _build(root: Path) -> dict[str, Any]:
    return build_engines(root, EngineBuildSettings(workspace_mib=64), progress=lambda _line: None)


def test_each_engine_is_released_before_the_next_build(emulated_tensorrt: Emulation, tiny_bundle: Path,
                                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trt = emulated_tensorrt.tensorrt
    engines: list[weakref.ref[Any]] = []
    alive_at_build: list[int] = []
    deserialize, build = trt.Runtime.deserialize_cuda_engine, trt.Builder.build_serialized_network

    def tracked_deserialize(self: Any, data: Any) -> Any:
        engine = deserialize(self, data)
        engines.append(weakref.ref(engine))
        return engine

    def tracked_build(self: Any, network: Any, config: Any) -> Any:
        gc.collect()
        alive_at_build.append(sum(ref() is not None for ref in engines))
        return build(self, network, config)

    monkeypatch.setattr(trt.Runtime, "deserialize_cuda_engine", tracked_deserialize)
    monkeypatch.setattr(trt.Builder, "build_serialized_network", tracked_build)
    built = _build(_copy(tiny_bundle, tmp_path))
    assert len(engines) == len([r for r in built["stages"].values() if "engine_of" not in r]) > 2
    assert alive_at_build == [0] * len(engines), "an earlier stage's engine was alive while the next one built"


def test_a_timing_cache_from_another_device_is_replaced(tiny_bundle: Path, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    if real_tensorrt_present():
        not_here("a real TensorRT is importable here; the emulator never replaces it")
    root = _copy(tiny_bundle, tmp_path)
    with emulated_tensorrt("10.3", RTX_4090):
        _build(root)
    made_on = planfmt.parse_cache((root / TIMING_CACHE).read_bytes())
    assert made_on is not None and made_on["gpu"] == RTX_4090.name and made_on["entries"]

    with caplog.at_level(logging.WARNING, logger="cosyedge_build.tensorrt.engines"), \
            emulated_tensorrt("10.3", JETSON_ORIN_NANO) as emu:
        _build(root)
    assert any("another device" in r.getMessage() and TIMING_CACHE in r.getMessage() for r in caplog.records), \
        caplog.text
    # TensorRT itself said why it did not use the cache (its log), and cosyedge did not pretend otherwise
    assert any("setTimingCache" in m for _, m in emu.journal)
    replaced = planfmt.parse_cache((root / TIMING_CACHE).read_bytes())
    assert replaced is not None and replaced["gpu"] == JETSON_ORIN_NANO.name and replaced["entries"]

    caplog.clear()  # the same device again: the cache is used, nothing reported
    with caplog.at_level(logging.WARNING, logger="cosyedge_build.tensorrt.engines"), \
            emulated_tensorrt("10.3", JETSON_ORIN_NANO):
        _build(root)
    assert not [r for r in caplog.records if "another device" in r.getMessage()]
    again = planfmt.parse_cache((root / TIMING_CACHE).read_bytes())
    assert again is not None and again["entries"] == replaced["entries"]
