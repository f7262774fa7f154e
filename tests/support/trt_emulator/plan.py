"""The emulated serialized engine ("plan"): a header (TensorRT version, the GPU it was built for,
profiles, precision, I/O) and the ONNX graph the engine runs, plus the emulated timing cache blob.

Engine compatibility (TensorRT developer guide, "Engine Compatibility" / "Version Compatibility"
and "Hardware Compatibility", https://docs.nvidia.com/deeplearning/tensorrt/latest/inference-library/advanced.html):
by default a plan runs only with the TensorRT version that built it and on GPUs of the same compute
capability; the emulator refuses anything else."""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field
from typing import Any

import onnx

MAGIC = b"EMUTRT-PLAN\x00"
CACHE_MAGIC = b"EMUTRT-CACHE\x00"


@dataclass
class TensorInfo:
    name: str
    is_input: bool
    dtype: int  # trt_types.DataType value
    shape: list[int]  # -1: dynamic


@dataclass
class PlanHeader:
    tensorrt: str
    gpu: str
    compute_capability: list[int]
    strongly_typed: bool
    flags: list[str]
    io: list[TensorInfo]
    profiles: list[dict[str, list[list[int]]]]  # per profile: input -> [min, opt, max]
    weights_bytes: int
    activation_bytes: int
    fp32_layers: list[str] = field(default_factory=list)


def serialize(header: PlanHeader, model: onnx.ModelProto) -> bytes:
    head = json.dumps(asdict(header)).encode()
    return MAGIC + struct.pack("<Q", len(head)) + head + model.SerializeToString()


def parse(data: bytes) -> tuple[PlanHeader, bytes] | None:
    """None when the bytes are not an (emulated) plan."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8:
        return None
    (n,) = struct.unpack_from("<Q", data, len(MAGIC))
    start = len(MAGIC) + 8
    try:
        raw: dict[str, Any] = json.loads(data[start:start + n])
        raw["io"] = [TensorInfo(**t) for t in raw["io"]]
        header = PlanHeader(**raw)
    except (ValueError, TypeError, KeyError):
        return None
    return header, data[start + n:]


def cache_blob(tensorrt: str, gpu: str, cc: list[int], entries: list[str]) -> bytes:
    return CACHE_MAGIC + json.dumps({"tensorrt": tensorrt, "gpu": gpu, "cc": cc, "entries": sorted(entries)}).encode()


def parse_cache(data: bytes) -> dict[str, Any] | None:
    if not data.startswith(CACHE_MAGIC):
        return None
    try:
        out: dict[str, Any] = json.loads(data[len(CACHE_MAGIC):])
    except ValueError:
        return None
    return out
