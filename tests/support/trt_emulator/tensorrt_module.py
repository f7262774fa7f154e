"""The emulated `tensorrt` module for one TensorRT version on one emulated GPU."""

from __future__ import annotations

import math
import types
from typing import Any

import onnx

from tests.support.trt_emulator import builder as b
from tests.support.trt_emulator import plan as planfmt
from tests.support.trt_emulator import runtime as r
from tests.support.trt_emulator.machine import EmulatedGpu, Machine
from tests.support.trt_emulator.shapes import EngineModel
from tests.support.trt_emulator.trt_types import (
    VERSIONS,
    DataType,
    Dims,
    ExecutionContextAllocationStrategy,
    ILogger,
    Logger,
    MemoryPoolType,
    NetworkDefinitionCreationFlag,
    TensorIOMode,
    builder_flag_enum,
    nptype,
)
from tests.support.trt_emulator.trt_types import minor as version_tuple


class TrtEnv:
    """What every emulated TensorRT object shares: the version, the GPU, the journal of messages."""

    def __init__(self, machine: Machine, version: str) -> None:
        if version not in VERSIONS:
            raise ValueError(f"emulated TensorRT versions: {sorted(VERSIONS)}, not {version!r}")
        self.machine = machine
        self.gpu: EmulatedGpu = machine.gpu
        self.version = version
        self.full_version = VERSIONS[version]
        self.major = version_tuple(self.full_version)[0]
        self.BuilderFlag = builder_flag_enum(self.full_version)
        self.journal: list[tuple[int, str]] = []  # (severity, message): everything "TensorRT" logged

    def runtime_context(self) -> bool:
        """TensorRT calls the CUDA runtime, which makes the device's primary context current on a thread
        that has none (CUDA runtime API, "Initialization")."""
        if not self.machine.initialized:
            self.machine.initialized = True
        if self.machine.current_context() is None:
            self.machine.set_current(self.machine.primary_context)
        return True

    def engine_model(self, onnx_bytes: bytes) -> EngineModel:
        return EngineModel(onnx_bytes)

    def shapes_for(self, model: onnx.ModelProto) -> EngineModel:
        return EngineModel(model.SerializeToString())

    @staticmethod
    def activation_bytes(io: list[planfmt.TensorInfo], profiles: list[dict[str, list[list[int]]]]) -> int:
        """GUESS (invented size): 1 MiB plus twice the I/O bytes at the largest profile, 256-byte aligned."""
        biggest = 0
        for prof in profiles:
            total = 0
            for t in io:
                shape = prof[t.name][2] if t.name in prof else [max(d, 1) for d in t.shape]
                total += int(math.prod(shape)) * 4
            biggest = max(biggest, total)
        return (2 * biggest + (1 << 20) + 255) // 256 * 256


def make_tensorrt(env: TrtEnv) -> types.ModuleType:
    mod = types.ModuleType("tensorrt")
    bound: dict[str, Any] = {
        "Builder": type("Builder", (b.Builder,), {"_env": env}),
        "OnnxParser": type("OnnxParser", (b.OnnxParser,), {"_env": env}),
        "Runtime": type("Runtime", (r.Runtime,), {"_env": env}),
    }
    names: dict[str, Any] = {
        "__version__": env.full_version,
        "Logger": Logger, "ILogger": ILogger, "Dims": Dims, "DataType": DataType, "nptype": nptype,
        "TensorIOMode": TensorIOMode, "MemoryPoolType": MemoryPoolType, "BuilderFlag": env.BuilderFlag,
        "NetworkDefinitionCreationFlag": NetworkDefinitionCreationFlag,
        "ExecutionContextAllocationStrategy": ExecutionContextAllocationStrategy,
        "ICudaEngine": r.ICudaEngine, "IExecutionContext": r.IExecutionContext, "IHostMemory": b.IHostMemory,
        "INetworkDefinition": b.INetworkDefinition, "IBuilderConfig": b.IBuilderConfig,
        "IOptimizationProfile": b.IOptimizationProfile, "ITimingCache": b.ITimingCache, "ILayer": b.ILayer,
        "ITensor": b.ITensor,
        "float32": DataType.FLOAT, "float16": DataType.HALF, "int8": DataType.INT8, "int32": DataType.INT32,
        "int64": DataType.INT64, "bool": DataType.BOOL, "uint8": DataType.UINT8, "bfloat16": DataType.BF16,
        **bound,
    }
    for k, v in names.items():
        setattr(mod, k, v)
    return mod
