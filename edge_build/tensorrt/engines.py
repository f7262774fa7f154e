"""`cosyedge build engines`: one TensorRT engine per stage from the bundle's
ONNX, on the device that will run it.

Uses the TensorRT 10 Python API as typed by tensorrt-stubs 10.13 (JetPack
7.0); every call also exists in TensorRT 10.3 (JetPack 6.2): Builder,
create_network(STRONGLY_TYPED), OnnxParser.parse_from_file, IBuilderConfig
(set_memory_pool_limit(WORKSPACE), add_optimization_profile,
create_timing_cache / set_timing_cache, ITimingCache.serialize),
build_serialized_network, Runtime.deserialize_cuda_engine,
device_memory_size_v2 (10.1+); and TensorRT 11, which has no weak typing:
every network is strongly typed, its precision carried by the ONNX graph
(engine_plan.precision_mode), with no precision builder flags.

Besides the six dynamic stages it builds one engine per fixed-shape stage
the bundle has (FIXED_SHAPE_PREFIXES: the flow estimator windows, the
vocoder lengths, the flow encoder windows), recorded in the same `engines`
section; the loader takes them where their plans exist (optional: a bundle
built before them still loads). Their inputs are all static; TensorRT
generates a default optimization profile for such a network, and one given
explicitly is allowed (IOptimizationProfile's documentation), so they get
the one their manifest entry yields, min = opt = max (build_profiles), and
the engines section and TrtSession read it like any other. The precision
rule is the same (precision_mode on their own ONNX).

The decisions (precision mode, profiles, workspace) are made in
edge_build/tensorrt/engine_plan.py, which needs no TensorRT and is tested on the CPU.
The timing cache persists in the bundle (`timing.cache`), so a rebuild after
a re-export reuses the measured tactics; a cache made on another device or
TensorRT version is refused by set_timing_cache(ignore_mismatch=False), which
is logged and the cache replaced by a fresh one (written back after the
build). Each stage's network, config, plan and deserialized engine are
released before the next stage builds: on an 8 GB board they share the DRAM
the builder needs."""

from __future__ import annotations

import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx
from cosyedge_build.tensorrt.engine_plan import (
    batch_caps,
    build_profiles,
    engine_stages,
    is_fixed_shape,
    precision_mode,
    prefill_profiles,
    resolve_board,
    workspace_bytes,
)
from cosyedge_models.backends.engine_meta import plan_file_name, with_engines, write_manifest
from cosyedge_models.backends.gpu_probe import import_tensorrt, local_identity, probe_gpu
from cosyedge_models.backends.profiles import stage_profiles
from cosyedge_models.bundle.loader import STAGES, load_bundle, sha256_file
from cosyedge_models.bundle.memory_budget import BOARDS, MIB, bundle_budget
from cosyedge_models.errors import BundleError, SynthesisError
from google.protobuf.message import DecodeError

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)
TIMING_CACHE = "timing.cache"


@dataclass(frozen=True)
class EngineBuildSettings:
    precision: str | None = None  # None: the bundle's own
    board: str | None = None  # BOARDS key; None: guessed from the GPU's memory on Jetson
    workspace_mib: int | None = None  # None: the board's default
    max_batch: int | None = None  # caps B (and N = 2B) in every profile
    # None: the six dynamic STAGES and every fixed-shape stage of the bundle (engine_stages)
    stages: tuple[str, ...] | None = None
    device_id: int = 0

    def __post_init__(self) -> None:
        if self.board is not None:
            resolve_board(self.board)
        unknown = [s for s in self.stages or () if s not in STAGES and not is_fixed_shape(s)]
        if unknown:
            raise ValueError(f"unknown stages {unknown}; allowed: {', '.join(STAGES)} and the bundle's "
                             "fixed-shape stages")
        if self.max_batch is not None and self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")


def guess_board(name: str, total_memory_bytes: int) -> str | None:
    """A Jetson (integrated GPU named 'Orin') is sized by its shared memory."""
    if "orin" not in name.lower():
        return None
    for key, board in sorted(BOARDS.items(), key=lambda kv: kv[1].usable_bytes):
        if total_memory_bytes <= board.usable_bytes * 1.1:
            return key
    return None


def _write_atomic(path: Path, data: bytes | memoryview) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data)
    os.replace(tmp, path)


def attach_timing_cache(config: trt.IBuilderConfig, cache_bytes: bytes, source: Path) -> trt.ITimingCache:
    """The builder's timing cache: `cache_bytes` (read from `source`) when this
    device and TensorRT accept it, else a fresh one (logged)."""
    cache = config.create_timing_cache(cache_bytes)
    if config.set_timing_cache(cache, ignore_mismatch=False):
        return cache
    log.warning("%s was made on another device or TensorRT version; building with a fresh timing cache, "
                "which replaces it", source)
    cache = config.create_timing_cache(b"")
    if not config.set_timing_cache(cache, ignore_mismatch=False):
        raise SynthesisError("TensorRT refused an empty timing cache")
    return cache


def _parse(builder: trt.Builder, onnx_path: Path) -> tuple[trt.INetworkDefinition, Any]:
    import tensorrt as trt
    from cosyedge_models.backends.tensorrt.session import trt_logger

    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, trt_logger())
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise SynthesisError(f"{onnx_path.name}: TensorRT's ONNX parser failed: {errors}")
    return network, parser  # the parser must outlive the network's use


ENGINE_PRECISIONS = ("fp32", "fp16", "int8")


def _device_memory_bytes(runtime: trt.Runtime, plan: bytes) -> int | None:
    """The engine's activation memory; the engine is released on return, before
    the next stage builds (peak memory on a board that shares its DRAM)."""
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:
        return None
    try:
        return int(engine.device_memory_size_v2)
    finally:
        del engine


def build_engines(bundle_dir: Path | str, settings: EngineBuildSettings | None = None,
                  progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Build and record the engines; returns the manifest's new `engines` section."""
    settings = settings or EngineBuildSettings()
    root = Path(bundle_dir)
    bundle = load_bundle(root, settings.precision)
    if bundle.precision not in ENGINE_PRECISIONS:
        raise BundleError(f"{root}: TensorRT engines are built from fp32, fp16 or int8 (Q/DQ) stages, not "
                          f"{bundle.precision} (an onnxruntime-only format); pass --precision int8 or fp16")
    import_tensorrt()
    import tensorrt as trt
    from cosyedge_models.backends.cuda import driver
    from cosyedge_models.backends.tensorrt.session import thread_cuda, trt_logger

    identity = local_identity(settings.device_id)
    gpu = {d.index: d for d in probe_gpu().devices}[settings.device_id]
    board = settings.board or guess_board(gpu.name, gpu.total_memory_bytes)
    workspace = workspace_bytes(board, settings.workspace_mib)
    driver()
    thread_cuda(settings.device_id)
    builder = trt.Builder(trt_logger())
    runtime = trt.Runtime(trt_logger())
    cache_path = root / TIMING_CACHE
    cache_bytes = cache_path.read_bytes() if cache_path.exists() else b""
    cache: trt.ITimingCache | None = None
    progress(f"TensorRT {identity.tensorrt} on {identity.gpu} (cc {identity.compute_capability}); "
             f"board {board or 'not a Jetson'}; workspace {workspace // MIB} MiB; precision {bundle.precision}")
    old = bundle.manifest.get("engines") or {}
    same = (old.get("precision") == bundle.precision and old.get("gpu") == identity.gpu
            and old.get("tensorrt") == identity.tensorrt)
    # Keep earlier plans only when they are for this precision, GPU and TensorRT (a partial rebuild).
    records: dict[str, Any] = dict(old.get("stages", {})) if same else {}
    # One LLM engine when llm_decode's profiles include the prefill's: llm_prefill is recorded
    # as that engine (same plan file, one copy of the weights in device memory)
    todo = engine_stages(settings.stages, bundle.stages)
    served = prefill_profiles(bundle.stages["llm_decode"].raw) if "llm_decode" in todo else []
    one_llm = bool(served)
    for stage in todo:
        if stage == "llm_prefill" and one_llm:
            continue
        info = bundle.stages[stage]
        onnx_path = info.path
        try:
            model = onnx.load(str(onnx_path), load_external_data=False)
        except (DecodeError, OSError) as exc:
            raise BundleError(f"{stage}: {onnx_path.name} is not a readable ONNX graph ({exc}); "
                              "re-export the bundle") from exc
        mode = precision_mode(model, info.raw.get("fp32_nodes", ()))
        caps = batch_caps(stage_profiles(info.raw, stage), settings.max_batch)
        profiles = build_profiles(info.raw, stage, model, caps)
        t0 = time.monotonic()
        network, parser = _parse(builder, onnx_path)
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace)
        for prof in profiles:
            p = builder.create_optimization_profile()
            for name, rng in prof.items():
                p.set_shape(name, trt.Dims(list(rng.min)), trt.Dims(list(rng.opt)), trt.Dims(list(rng.max)))
            config.add_optimization_profile(p)
        if cache is None:
            cache = attach_timing_cache(config, cache_bytes, cache_path)
        elif not config.set_timing_cache(cache, ignore_mismatch=False):
            raise SynthesisError(f"{stage}: TensorRT refused the timing cache it made for the previous stage")
        progress(f"{stage}: building from {onnx_path.name} (strongly typed; {mode.reason})")
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise SynthesisError(f"{stage}: TensorRT could not build the engine (see the TensorRT log above; "
                              f"a smaller --workspace-mib or --max-batch may help on a small board)")
        del parser, network, config
        plan_name = plan_file_name(stage, bundle.precision)
        _write_atomic(root / plan_name, memoryview(serialized))
        del serialized
        device_memory = _device_memory_bytes(runtime, (root / plan_name).read_bytes())
        records[stage] = {
            "file": plan_name,
            "sha256": sha256_file(root / plan_name),
            "plan_bytes": (root / plan_name).stat().st_size,
            "onnx": onnx_path.name,
            "onnx_sha256": info.sha256 or sha256_file(onnx_path),
            "precision": info.precision,
            "strongly_typed": True,
            "precision_from": mode.carried_by,
            "fp32_nodes": len(mode.fp32_nodes),
            "profiles": [{n: [list(r.min), list(r.opt), list(r.max)] for n, r in p.items()} for p in profiles],
            "device_memory_bytes": device_memory,
            "build_seconds": round(time.monotonic() - t0, 1),
        }
        progress(f"{stage}: {plan_name} {records[stage]['plan_bytes'] / MIB:.1f} MiB in "
                 f"{records[stage]['build_seconds']} s")
        if cache is not None:
            _write_atomic(cache_path, memoryview(cache.serialize()))
    # a fixed-shape stage the bundle no longer has (re-exported with other windows) loses its record
    records = {n: r for n, r in records.items() if not is_fixed_shape(n) or n in bundle.stages}
    if one_llm:
        records["llm_prefill"] = {**records["llm_decode"], "engine_of": "llm_decode", "profiles_used": served}
        progress("llm_prefill: served by the llm_decode engine (its prefill profile; one copy of the weights)")
    engines = {
        "tensorrt": identity.tensorrt,
        "gpu": identity.gpu,
        "compute_capability": identity.compute_capability,
        "multiprocessors": identity.multiprocessors,
        "cuda_driver": probe_gpu().driver_version,
        "host": platform.node(),
        "built": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "precision": bundle.precision,
        "board": board,
        "workspace_bytes": workspace,
        "timing_cache": TIMING_CACHE,
        "stages": records,
    }
    missing = [s for s in STAGES if s not in records]
    if missing:
        raise BundleError(f"engines are missing for {missing}; build all stages (omit --stages)")
    manifest = with_engines(bundle.manifest, engines)
    write_manifest(root, manifest)
    budget = bundle_budget(root, manifest, bundle.precision)
    if board:
        fit = budget.fit(BOARDS[board])
        progress(f"memory on {fit['label']}: needs {fit['needed_bytes'] / MIB:.0f} MiB of "
                 f"{fit['limit_bytes'] / MIB:.0f} MiB usable -> {'fits' if fit['fits'] else 'DOES NOT FIT'}")
    return engines
