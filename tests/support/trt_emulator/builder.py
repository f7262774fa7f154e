"""Builder side: Builder, INetworkDefinition (from the ONNX parser), IBuilderConfig,
IOptimizationProfile, ITimingCache, IHostMemory.

Sources:
  Builder / NetworkDefinitionCreationFlag: .../python-api/infer/Core/Builder.html
  IBuilderConfig, BuilderFlag, MemoryPoolType: .../python-api/infer/Core/BuilderConfig.html
  IOptimizationProfile.set_shape (the three conditions, ValueError): .../infer/Core/OptimizationProfile.html
  INetworkDefinition / ILayer (precision, set_output_type): .../infer/Graph/Network.html, .../Graph/Layers.html
  OnnxParser: .../python-api/parsers/Onnx/pyOnnx.html
  (... = https://docs.nvidia.com/deeplearning/tensorrt/latest/_static/python-api)"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from tests.support.trt_emulator import plan as planfmt
from tests.support.trt_emulator.trt_types import ONNX_TO_TRT, WEAK_TYPING_FLAGS, DataType, Dims, Logger, minor, report

if TYPE_CHECKING:
    from tests.support.trt_emulator.tensorrt_module import TrtEnv

_SEV = Logger


class IHostMemory(bytes):
    """Serialized engine / timing cache (buffer protocol, like TensorRT's)."""

    @property
    def nbytes(self) -> int:
        return len(self)


@dataclass
class ITensor:
    name: str
    dtype: DataType
    shape: Dims
    is_network_input: bool = False
    is_network_output: bool = False


class ILayer:
    def __init__(self, net: INetworkDefinition, node: onnx.NodeProto, index: int, outputs: list[ITensor]) -> None:
        self._net = net
        self.name = node.name or f"{node.op_type}_{index}"
        self.type = node.op_type
        self.metadata = f"[ONNX Layer: {self.name}]"
        self._outputs = outputs
        self._precision: DataType | None = None
        self.output_types: dict[int, DataType] = {}

    @property
    def num_outputs(self) -> int:
        return len(self._outputs)

    def get_output(self, i: int) -> ITensor:
        return self._outputs[i]

    @property
    def precision(self) -> DataType:
        return self._precision if self._precision is not None else DataType.FLOAT

    @precision.setter
    def precision(self, dt: DataType) -> None:
        self._net.weak_typing_call("ILayer.precision", self.name)
        self._precision = DataType(dt)

    @property
    def precision_is_set(self) -> bool:
        return self._precision is not None

    def set_output_type(self, index: int, dt: DataType) -> None:
        self._net.weak_typing_call("ILayer.set_output_type", self.name)
        if not 0 <= index < len(self._outputs):
            self._net.error(f"ILayer::setOutputType: index {index} out of range for layer {self.name}")
            return
        self.output_types[index] = DataType(dt)


class INetworkDefinition:
    def __init__(self, env: TrtEnv, logger: Any, flags: int) -> None:
        self._env, self._logger = env, logger
        self.flags = flags
        self.strongly_typed = bool(flags & (1 << 1))
        self.model: onnx.ModelProto | None = None
        self.inputs: list[ITensor] = []
        self.outputs: list[ITensor] = []
        self.layers: list[ILayer] = []
        self.invalid: list[str] = []  # API misuse the build will refuse

    def error(self, msg: str) -> None:
        report(self._logger, _SEV.ERROR, msg, self._env.journal)

    def weak_typing_call(self, api: str, layer: str) -> None:
        if self._env.major >= 11:
            # TensorRT 11 removed the weak-typing API (deprecated since 10.12)
            raise AttributeError(f"{api} does not exist in TensorRT {self._env.version}")
        if self.strongly_typed:
            # Builder.html, STRONGLY_TYPED: "Setting layer precision and layer output types is not allowed"
            msg = f"{api} on layer {layer}: not allowed in a strongly typed network"
            self.error(msg)
            self.invalid.append(msg)

    @property
    def num_inputs(self) -> int:
        return len(self.inputs)

    @property
    def num_outputs(self) -> int:
        return len(self.outputs)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def get_input(self, i: int) -> ITensor:
        return self.inputs[i]

    def get_output(self, i: int) -> ITensor:
        return self.outputs[i]

    def get_layer(self, i: int) -> ILayer:
        return self.layers[i]

    def get_flag(self, flag: int) -> bool:
        return bool(self.flags & (1 << int(flag)))

    def populate(self, model: onnx.ModelProto) -> list[str]:
        """Fill the network from an ONNX model; returns parser errors."""
        errors: list[str] = []
        inits = {t.name for t in model.graph.initializer}

        def tensor(vi: onnx.ValueInfoProto, inp: bool) -> ITensor | None:
            tt = vi.type.tensor_type
            dt = ONNX_TO_TRT.get(tt.elem_type)
            if dt is None:
                errors.append(f"{vi.name}: ONNX type {onnx.TensorProto.DataType.Name(tt.elem_type)} is not a "
                              "TensorRT I/O type")
                return None
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim]
            return ITensor(vi.name, dt, Dims(dims), is_network_input=inp, is_network_output=not inp)

        for vi in model.graph.input:
            if vi.name not in inits and (t := tensor(vi, True)) is not None:
                self.inputs.append(t)
        for vi in model.graph.output:
            if (t := tensor(vi, False)) is not None:
                self.outputs.append(t)
        for i, node in enumerate(model.graph.node):
            outs = [ITensor(o, DataType.FLOAT, Dims()) for o in node.output]
            self.layers.append(ILayer(self, node, i, outs))
        self.model = model
        return errors


class ParserError:
    def __init__(self, desc: str) -> None:
        self._desc = desc

    def desc(self) -> str:
        return self._desc

    def code(self) -> int:
        return 1

    def __str__(self) -> str:
        return self._desc


class OnnxParser:
    _env: TrtEnv

    def __init__(self, network: INetworkDefinition, logger: Any) -> None:
        self._network, self._logger = network, logger
        self._errors: list[ParserError] = []

    @property
    def num_errors(self) -> int:
        return len(self._errors)

    def get_error(self, i: int) -> ParserError:
        return self._errors[i]

    def clear_errors(self) -> None:
        self._errors.clear()

    def _fail(self, msg: str) -> bool:
        self._errors.append(ParserError(msg))
        report(self._logger, _SEV.ERROR, f"ModelImporter: {msg}", self._env.journal)
        return False

    def parse_from_file(self, model: str) -> bool:
        if not os.path.exists(model):
            return self._fail(f"Failed to open file: {model}")
        try:
            proto = onnx.load(model)  # with its external data, as the parser reads it
        except Exception as exc:
            return self._fail(f"Failed to parse ONNX model from file {model}: {exc}")
        return self._parse_model(proto)

    def parse(self, model: bytes, path: str | None = None) -> bool:
        try:
            proto = onnx.load_from_string(bytes(model))
        except Exception as exc:
            return self._fail(f"Failed to parse ONNX model: {exc}")
        return self._parse_model(proto)

    def _parse_model(self, proto: onnx.ModelProto) -> bool:
        try:
            onnx.checker.check_model(proto)
        except onnx.checker.ValidationError as exc:
            return self._fail(f"invalid ONNX model: {str(exc).splitlines()[0]}")
        errors = self._network.populate(proto)
        for e in errors:
            self._fail(e)
        return not errors


class IOptimizationProfile:
    def __init__(self) -> None:
        self.shapes: dict[str, tuple[Dims, Dims, Dims]] = {}

    def set_shape(self, input: str, min: Any, opt: Any, max: Any) -> None:  # noqa: A002 - TensorRT's names
        lo, mid, hi = Dims(min), Dims(opt), Dims(max)
        # OptimizationProfile.html, set_shape: (1) equal ranks, (2) 0 <= min <= opt <= max,
        # ":raises: ValueError if an inconsistency was detected"
        if not len(lo) == len(mid) == len(hi):
            raise ValueError(f"set_shape({input}): min, opt and max must have the same rank")
        if any(not 0 <= a <= b <= c for a, b, c in zip(lo, mid, hi, strict=False)):
            raise ValueError(f"set_shape({input}): needs 0 <= min <= opt <= max in every dimension, got "
                             f"{lo} {mid} {hi}")
        self.shapes[input] = (lo, mid, hi)

    def get_shape(self, input: str) -> list[Dims]:  # noqa: A002
        return list(self.shapes.get(input, ()))

    def __bool__(self) -> bool:
        return True


class ITimingCache:
    def __init__(self, env: TrtEnv, origin: dict[str, Any] | None, entries: set[str]) -> None:
        self._env = env
        self.origin = origin  # None: made here, empty
        self.entries = entries

    def matches(self) -> bool:
        o = self.origin
        return o is None or (o["gpu"] == self._env.gpu.name and list(o["cc"]) == list(self._env.gpu.compute_capability)
                             and o["tensorrt"] == self._env.full_version)

    def serialize(self) -> IHostMemory:
        o = self.origin
        if o is None or self.matches():
            o = {"tensorrt": self._env.full_version, "gpu": self._env.gpu.name,
                 "cc": list(self._env.gpu.compute_capability)}
        return IHostMemory(planfmt.cache_blob(o["tensorrt"], o["gpu"], o["cc"], sorted(self.entries)))

    def reset(self) -> bool:
        self.entries.clear()
        return True


@dataclass
class IBuilderConfig:
    _env: TrtEnv
    _logger: Any
    flags: int = 0
    profiles: list[IOptimizationProfile] = field(default_factory=list)
    pool_limits: dict[int, int] = field(default_factory=dict)
    timing_cache: ITimingCache | None = None
    builder_optimization_level: int = 3

    def set_flag(self, flag: Any) -> None:
        self.flags |= 1 << int(flag)

    def clear_flag(self, flag: Any) -> None:
        self.flags &= ~(1 << int(flag))

    def get_flag(self, flag: Any) -> bool:
        return bool(self.flags & (1 << int(flag)))

    def set_memory_pool_limit(self, pool: Any, pool_size: int) -> None:
        if pool_size < 0:
            raise ValueError("set_memory_pool_limit: the size must not be negative")
        self.pool_limits[int(pool)] = int(pool_size)

    def get_memory_pool_limit(self, pool: Any) -> int:
        return self.pool_limits.get(int(pool), self._env.gpu.total_memory_bytes)

    def add_optimization_profile(self, profile: IOptimizationProfile) -> int:
        if not profile.shapes:
            # IBuilderConfig.add_optimization_profile: "-1 if the input is not valid" (an empty profile)
            report(self._logger, _SEV.ERROR, "addOptimizationProfile: the profile sets no shape", self._env.journal)
            return -1
        self.profiles.append(profile)
        return len(self.profiles) - 1

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.profiles)

    def create_timing_cache(self, serialized_timing_cache: bytes) -> ITimingCache:
        data = bytes(serialized_timing_cache)
        if not data:
            return ITimingCache(self._env, None, set())
        parsed = planfmt.parse_cache(data)
        if parsed is None:
            # GUESS: an unreadable blob gives an empty cache and a warning
            report(self._logger, _SEV.WARNING, "createTimingCache: the serialized cache is invalid; starting empty",
                   self._env.journal)
            return ITimingCache(self._env, None, set())
        return ITimingCache(self._env, parsed, set(parsed["entries"]))

    def set_timing_cache(self, cache: ITimingCache, ignore_mismatch: bool) -> bool:
        """BuilderConfig.html, set_timing_cache: "ignore_mismatch: Whether or not allow using a cache that
        contains different CUDA device property"; returns whether it was set."""
        if not cache.matches() and not ignore_mismatch:
            report(self._logger, _SEV.WARNING, "setTimingCache: the cache was made for another device or "
                   "TensorRT version; not used", self._env.journal)
            return False
        self.timing_cache = cache
        return True

    def get_timing_cache(self) -> ITimingCache | None:
        return self.timing_cache


class Builder:
    _env: TrtEnv

    def __init__(self, logger: Any) -> None:
        self._logger = logger

    @property
    def platform_has_fast_fp16(self) -> bool:
        return True

    @property
    def platform_has_fast_int8(self) -> bool:
        return True

    def create_network(self, flags: int = 0) -> INetworkDefinition:
        return INetworkDefinition(self._env, self._logger, int(flags))

    def create_builder_config(self) -> IBuilderConfig:
        return IBuilderConfig(self._env, self._logger)

    def create_optimization_profile(self) -> IOptimizationProfile:
        return IOptimizationProfile()

    def _error(self, msg: str) -> None:
        report(self._logger, _SEV.ERROR, msg, self._env.journal)

    def build_serialized_network(self, network: INetworkDefinition, config: IBuilderConfig) -> IHostMemory | None:
        env = self._env
        if network.model is None:
            self._error("Network must have at least one output")
            return None
        if network.invalid:
            return None
        flag_names = [f.name for f in env.BuilderFlag if config.get_flag(f)]
        weak = [n for n in flag_names if n in WEAK_TYPING_FLAGS]
        if network.strongly_typed and weak:
            # Builder.html STRONGLY_TYPED: the types come from the network; precision flags do not apply.
            # GUESS (symptom): the build fails with an API usage error.
            self._error(f"BuilderFlags {weak} are not allowed for a strongly typed network")
            return None
        if weak and minor(env.full_version) >= (10, 12):
            report(self._logger, _SEV.WARNING, f"BuilderFlags {weak} are deprecated since TensorRT 10.12: use "
                   "strongly typed networks", env.journal)
        profiles = self._profiles(network, config)
        if profiles is None:
            return None
        model = network.model
        static = {}
        if all(all(d >= 0 for d in t.shape) for t in network.inputs):
            # a fully static network: TensorRT resolves every output shape at build time
            static = env.shapes_for(model).output_shapes({t.name: t.shape.tuple() for t in network.inputs})
        io = [planfmt.TensorInfo(t.name, True, int(t.dtype), list(t.shape)) for t in network.inputs]
        for t in network.outputs:
            dims = list(static.get(t.name, t.shape.tuple()))
            io.append(planfmt.TensorInfo(t.name, False, int(t.dtype), dims))
        weights = sum(int(np.prod(i.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(i.data_type).itemsize
                      for i in model.graph.initializer)
        activation = env.activation_bytes(io, profiles)
        if config.timing_cache is not None:
            config.timing_cache.entries.update(f"{layer.type}:{layer.name}" for layer in network.layers)
        header = planfmt.PlanHeader(
            tensorrt=env.full_version, gpu=env.gpu.name, compute_capability=list(env.gpu.compute_capability),
            strongly_typed=network.strongly_typed, flags=flag_names, io=io, profiles=profiles,
            weights_bytes=weights, activation_bytes=activation,
            fp32_layers=[layer.name for layer in network.layers if layer.precision_is_set])
        return IHostMemory(planfmt.serialize(header, model))

    def _profiles(self, network: INetworkDefinition, config: IBuilderConfig) -> list[dict[str, list[list[int]]]] | None:
        dynamic = [t for t in network.inputs if any(d < 0 for d in t.shape)]
        if dynamic and not config.profiles:
            self._error("Network has dynamic or shape inputs, but no optimization profile has been defined.")
            return None
        out = []
        profiles = config.profiles or [IOptimizationProfile()]
        names = {t.name for t in network.inputs}
        for p, prof in enumerate(profiles):
            unknown = [n for n in prof.shapes if n not in names]
            if unknown:
                self._error(f"Optimization profile {p} names tensors that are not network inputs: {unknown}")
                return None
            entry: dict[str, list[list[int]]] = {}
            for t in network.inputs:
                rng = prof.shapes.get(t.name)
                if rng is None:
                    if any(d < 0 for d in t.shape):
                        # set_shape: "This function must be called for any network input tensor that has
                        # dynamic dimensions"
                        self._error(f"{t.name}: dynamic input is missing dimensions in profile {p}.")
                        return None
                    rng = (t.shape, t.shape, t.shape)
                lo, mid, hi = rng
                if len(lo) != len(t.shape):
                    self._error(f"{t.name}: profile {p} has rank {len(lo)}, the network input rank {len(t.shape)}")
                    return None
                for i, d in enumerate(t.shape):
                    # set_shape condition (3): a static dimension must be min == opt == max == that dimension
                    if d >= 0 and not lo[i] == mid[i] == hi[i] == d:
                        self._error(f"{t.name}: profile {p} dimension {i} must be {d} (static in the network), got "
                                    f"{lo[i]}/{mid[i]}/{hi[i]}")
                        return None
                entry[t.name] = [list(lo), list(mid), list(hi)]
            out.append(entry)
        return out
