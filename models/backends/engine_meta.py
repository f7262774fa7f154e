"""The manifest's `engines` section: what `cosyedge build engines` records
about the TensorRT plans it wrote, and the check that refuses plans built for
another GPU or TensorRT version. Pure logic (no TensorRT, no GPU); the local
identity is probed by `cosyedge_models.backends.gpu_probe`.

```json
"engines": {
  "tensorrt": "10.3.0.30", "gpu": "Orin", "compute_capability": "8.7",
  "multiprocessors": 8, "cuda_driver": 12060, "host": "orin-nano", "built": "2026-11-30T10:00:00Z",
  "precision": "int8", "board": "orin-nano-8gb", "workspace_bytes": 1073741824,
  "timing_cache": "timing.cache",
  "stages": {"llm_decode": {"file": "llm_decode.int8.plan", "sha256": "...", "plan_bytes": 123,
                            "onnx": "llm_decode.int8.onnx", "onnx_sha256": "...", "precision": "int8",
                            "strongly_typed": true, "precision_from": "Q/DQ", "fp32_nodes": 12,
                            "profiles": [{"P": [1, 256, 2048], "B": [1, 1, 1]}],
                            "device_memory_bytes": 4194304, "build_seconds": 81.2},
             "llm_prefill": {"file": "llm_decode.int8.plan", "engine_of": "llm_decode", "...": "..."}}
}
```

`engine_of`: the stage runs on that stage's engine (one plan; here the LLM engine whose prefill
profile serves llm_prefill: one copy of the weights, edge_build/tensorrt/engines.py).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosyedge_models.errors import BundleError

REBUILD_HINT = "rebuild them on this device with: cosyedge build engines --bundle {root}"
ENGINE_FIELDS = ("tensorrt", "gpu", "compute_capability", "stages")


@dataclass(frozen=True)
class EngineIdentity:
    """What a TensorRT plan is tied to: the TensorRT version that serialized it
    and the GPU model it was tuned for."""

    tensorrt: str
    gpu: str
    compute_capability: str  # "8.7"
    multiprocessors: int | None = None


def plan_file_name(stage: str, precision: str) -> str:
    return f"{stage}.{precision}.plan"


def trt_release(version: str) -> tuple[int, ...]:
    """major.minor.patch of a TensorRT version string ('10.3.0.30' -> (10, 3, 0)).
    Plans are tied to the release; the fourth (build) component is not compared."""
    parts = []
    for p in version.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def engine_mismatches(meta: Mapping[str, Any], local: EngineIdentity) -> list[str]:
    """Human-readable reasons the recorded engines cannot run here (empty: they can)."""
    problems = []
    built_trt = str(meta.get("tensorrt", "?"))
    if trt_release(built_trt) != trt_release(local.tensorrt):
        problems.append(f"built with TensorRT {built_trt}, this device has TensorRT {local.tensorrt}")
    built_cc = str(meta.get("compute_capability", "?"))
    built_gpu = str(meta.get("gpu", "?"))
    if built_cc != local.compute_capability:
        problems.append(f"built for compute capability {built_cc} ({built_gpu}), "
                        f"this GPU is {local.compute_capability} ({local.gpu})")
    elif built_gpu != local.gpu:
        problems.append(f"built for GPU {built_gpu!r}, this GPU is {local.gpu!r}")
    return problems


def engine_warnings(meta: Mapping[str, Any], local: EngineIdentity) -> list[str]:
    """Differences that TensorRT accepts but that make the plan's tactics suboptimal
    (e.g. an Orin Nano plan on an Orin NX: same name and compute capability,
    another multiprocessor count)."""
    built = meta.get("multiprocessors")
    if built is not None and local.multiprocessors is not None and int(built) != local.multiprocessors:
        return [f"engines were tuned on a GPU with {built} multiprocessors, this one has {local.multiprocessors}; "
                "they run, but rebuilding on this device may be faster"]
    return []


def check_engines(manifest: Mapping[str, Any], root: Path, local: EngineIdentity,
                  optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """The `engines` section if its plans can run on `local`; else a BundleError
    that says why and how to rebuild. Stages named with an `optional` prefix (the
    fixed-shape ones) may lack their plan file: the loader then runs without them."""
    meta = manifest.get("engines")
    hint = REBUILD_HINT.format(root=root)
    if not meta:
        raise BundleError(f"{root}: the bundle has no TensorRT engines; build them on this device with: "
                          f"cosyedge build engines --bundle {root}")
    if not isinstance(meta, Mapping) or any(k not in meta for k in ENGINE_FIELDS):
        raise BundleError(f"{root}: manifest.json has a malformed 'engines' section "
                          f"(needs {', '.join(ENGINE_FIELDS)}); " + hint)
    problems = engine_mismatches(meta, local)
    if problems:
        raise BundleError(f"{root}: the TensorRT engines do not match this device: {'; '.join(problems)}; " + hint)
    stages = manifest.get("stages", {})
    for name, entry in meta["stages"].items():
        onnx_sha = entry.get("onnx_sha256")
        # a stage served by another stage's engine (llm_prefill by llm_decode's) is checked against that one's ONNX
        source = _stage_variant_sha(stages.get(str(entry.get("engine_of") or name), {}), str(entry.get("onnx", "")))
        if onnx_sha and source and onnx_sha != source:
            raise BundleError(f"{root}: engine {entry.get('file')} was built from another {entry.get('onnx')} than the "
                              "bundle now holds (it was re-exported or re-quantized since); " + hint)
        if not (root / str(entry.get("file", ""))).exists() and not str(name).startswith(optional):
            raise BundleError(f"{root}: engine file {entry.get('file')} is missing; " + hint)
    return dict(meta)


def _stage_variant_sha(stage: Mapping[str, Any], onnx_file: str) -> str | None:
    """sha256 the manifest lists for the ONNX file an engine was built from."""
    if stage.get("file") == onnx_file:
        return stage.get("sha256")
    for variant in stage.get("variants", {}).values():
        if variant.get("file") == onnx_file:
            return variant.get("sha256")
    return None


def with_engines(manifest: Mapping[str, Any], engines: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the manifest with its `engines` section replaced."""
    missing = [k for k in ENGINE_FIELDS if k not in engines]
    if missing:
        raise ValueError(f"engines section lacks {missing}")
    out = dict(manifest)
    out["engines"] = dict(engines)
    return out


def write_manifest(root: Path, manifest: Mapping[str, Any]) -> None:
    """Atomically replace root/manifest.json (a crash leaves the old one)."""
    fd, tmp = tempfile.mkstemp(prefix=".manifest-", suffix=".json", dir=root)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(manifest, f, indent=2)
            f.write("\n")
        os.replace(tmp, root / "manifest.json")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
