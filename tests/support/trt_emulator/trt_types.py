"""TensorRT's enums, Dims, Logger and DataType helpers, per emulated version.

Python API reference (TensorRT 10): https://docs.nvidia.com/deeplearning/tensorrt/latest/_static/python-api/
(Core/Logger.html, infer/FoundationalTypes/DataType.html, infer/FoundationalTypes/Dims.html,
infer/Core/BuilderConfig.html for BuilderFlag and MemoryPoolType); member values as in
tensorrt-stubs 10.13."""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from typing import Any

import numpy as np

log = logging.getLogger("tests.trt_emulator")

VERSIONS = {"10.3": "10.3.0.30", "10.13": "10.13.3.9", "11": "11.0.0.0"}  # 11's build number: GUESS

# In TensorRT 11 the weak-typing API is gone (deprecated since 10.12: release notes of 10.12 and the
# "Strongly Typed Networks" section of the developer guide); these BuilderFlag members go with it.
WEAK_TYPING_FLAGS = ("FP16", "BF16", "INT8", "FP8", "INT4", "FP4", "OBEY_PRECISION_CONSTRAINTS",
                     "PREFER_PRECISION_CONSTRAINTS")
_BUILDER_FLAGS = {
    "FP16": 0, "INT8": 1, "DEBUG": 2, "GPU_FALLBACK": 3, "REFIT": 4, "DISABLE_TIMING_CACHE": 5, "TF32": 6,
    "SPARSE_WEIGHTS": 7, "SAFETY_SCOPE": 8, "OBEY_PRECISION_CONSTRAINTS": 9, "PREFER_PRECISION_CONSTRAINTS": 10,
    "DIRECT_IO": 11, "REJECT_EMPTY_ALGORITHMS": 12, "VERSION_COMPATIBLE": 13, "EXCLUDE_LEAN_RUNTIME": 14,
    "FP8": 15, "ERROR_ON_TIMING_CACHE_MISS": 16, "BF16": 17, "DISABLE_COMPILATION_CACHE": 18, "WEIGHTLESS": 19,
    "REFIT_IDENTICAL": 20, "WEIGHT_STREAMING": 21, "INT4": 22, "REFIT_INDIVIDUAL": 23, "STRICT_NANS": 24,
    "MONITOR_MEMORY": 25, "FP4": 26, "EDITABLE_TIMING_CACHE": 27, "DISTRIBUTIVE_INDEPENDENCE": 28,
}
# the 10.x minor that added these (GUESS: only "after 10.3" is certain)
_FLAGS_SINCE = {"REFIT_INDIVIDUAL": 13, "STRICT_NANS": 13, "MONITOR_MEMORY": 13, "FP4": 13,
                "EDITABLE_TIMING_CACHE": 13, "DISTRIBUTIVE_INDEPENDENCE": 13}


def minor(version: str) -> tuple[int, int]:
    major, minor_, *_ = version.split(".") + ["0"]
    return int(major), int(minor_)


def builder_flag_enum(version: str) -> type[enum.IntEnum]:
    major, mnr = minor(version)
    members = {}
    for name, value in _BUILDER_FLAGS.items():
        if major >= 11 and name in WEAK_TYPING_FLAGS:
            continue
        if major == 10 and mnr < _FLAGS_SINCE.get(name, 0):
            continue
        members[name] = value
    return enum.IntEnum("BuilderFlag", members)  # type: ignore[return-value]


class NetworkDefinitionCreationFlag(enum.IntEnum):
    EXPLICIT_BATCH = 0  # deprecated and ignored in TensorRT 10 (explicit batch is the only mode)
    STRONGLY_TYPED = 1
    PREFER_JIT_PYTHON_PLUGINS = 2
    PREFER_AOT_PYTHON_PLUGINS = 3


class DataType(enum.IntEnum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8
    INT4 = 9
    FP4 = 10


_NP = {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT8: np.int8, DataType.INT32: np.int32,
       DataType.BOOL: np.bool_, DataType.UINT8: np.uint8, DataType.INT64: np.int64}
# ONNX TensorProto elem types -> TensorRT I/O types (the ONNX parser's; double and the unsigned
# types other than uint8 are not TensorRT types)
ONNX_TO_TRT = {1: DataType.FLOAT, 10: DataType.HALF, 3: DataType.INT8, 6: DataType.INT32, 9: DataType.BOOL,
               2: DataType.UINT8, 7: DataType.INT64, 16: DataType.BF16}


def nptype(dt: DataType) -> type:
    """tensorrt.nptype: the numpy type of a DataType (TypeError for types numpy lacks)."""
    try:
        return _NP[DataType(dt)]  # type: ignore[return-value]
    except KeyError:
        raise TypeError(f"Could not resolve TensorRT datatype to an equivalent numpy datatype: {dt}") from None


class TensorIOMode(enum.IntEnum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class MemoryPoolType(enum.IntEnum):
    WORKSPACE = 0
    DLA_MANAGED_SRAM = 1
    DLA_LOCAL_DRAM = 2
    DLA_GLOBAL_DRAM = 3
    TACTIC_DRAM = 4
    TACTIC_SHARED_MEMORY = 5


class ExecutionContextAllocationStrategy(enum.IntEnum):
    STATIC = 0
    ON_PROFILE_CHANGE = 1
    USER_MANAGED = 2


class Dims:
    """tensorrt.Dims: a shape; -1 marks a dimension not known yet."""

    MAX_DIMS = 8

    def __init__(self, shape: Iterable[int] = ()) -> None:
        self._d = [int(x) for x in shape]
        if len(self._d) > self.MAX_DIMS:
            raise ValueError(f"Dims: at most {self.MAX_DIMS} dimensions")

    def __len__(self) -> int:
        return len(self._d)

    def __getitem__(self, i: int) -> int:
        return self._d[i]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._d)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Dims):
            return self._d == other._d
        if isinstance(other, (tuple, list)):
            return self._d == [int(x) for x in other]
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self._d))

    def __repr__(self) -> str:
        return f"({', '.join(map(str, self._d))})"

    def tuple(self) -> tuple[int, ...]:
        return tuple(self._d)


class _Severity(enum.IntEnum):
    INTERNAL_ERROR = 0
    ERROR = 1
    WARNING = 2
    INFO = 3
    VERBOSE = 4


class ILogger:
    Severity = _Severity

    def log(self, severity: _Severity, msg: str) -> None:
        raise NotImplementedError


class Logger(ILogger):
    """tensorrt.Logger: prints messages at or above min_severity; the emulator also keeps them
    (`messages`) so tests can assert what TensorRT would have logged."""

    INTERNAL_ERROR = _Severity.INTERNAL_ERROR
    ERROR = _Severity.ERROR
    WARNING = _Severity.WARNING
    INFO = _Severity.INFO
    VERBOSE = _Severity.VERBOSE

    def __init__(self, min_severity: _Severity = _Severity.WARNING) -> None:
        self.min_severity = min_severity
        self.messages: list[tuple[_Severity, str]] = []

    def log(self, severity: _Severity, msg: str) -> None:
        self.messages.append((severity, msg))
        if severity <= self.min_severity:
            level = logging.ERROR if severity <= _Severity.ERROR else (
                logging.WARNING if severity == _Severity.WARNING else logging.INFO)
            log.log(level, "[TRT] %s", msg)


def report(logger: Any, severity: _Severity, msg: str, journal: list[tuple[int, str]]) -> None:
    """Log through the user's logger and the emulator's journal of everything TensorRT said."""
    journal.append((int(severity), msg))
    if logger is not None:
        logger.log(severity, msg)
