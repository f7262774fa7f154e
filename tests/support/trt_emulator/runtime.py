"""Runtime side: Runtime.deserialize_cuda_engine, ICudaEngine (tensors by name) and
IExecutionContext (shapes, addresses, execute_async_v3 on the emulated GPU, user-managed memory).

Sources (... = https://docs.nvidia.com/deeplearning/tensorrt/latest/_static/python-api/infer/Core):
  Runtime: .../Runtime.html ("deserialize_cuda_engine ... :returns: The ICudaEngine, or None if it
    could not be deserialized")
  ICudaEngine: .../Engine.html (get_tensor_* by name, get_tensor_profile_shape, device_memory_size_v2,
    create_execution_context(strategy))
  IExecutionContext: .../ExecutionContext.html (set_input_shape, set_tensor_address, execute_async_v3,
    set_optimization_profile_async, set_device_memory: "This must be at least as large as
    CudaEngine.get_device_memory_size_v2")
  C++ IExecutionContext::enqueueV3 / setInputShape (the conditions the Python calls check and log):
    https://docs.nvidia.com/deeplearning/tensorrt/latest/_static/c-api/classnvinfer1_1_1_i_execution_context.html
  Developer guide, "Working with Dynamic Shapes" and "CUDA Graphs" (enqueue once before capturing):
    https://docs.nvidia.com/deeplearning/tensorrt/latest/inference-library/work-dynamic-shapes.html
    https://docs.nvidia.com/deeplearning/tensorrt/latest/performance/best-practices.html#cuda-graphs"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from tests.support.trt_emulator import plan as planfmt
from tests.support.trt_emulator.machine import CudaError, Op, finalizer
from tests.support.trt_emulator.trt_types import (
    DataType,
    Dims,
    ExecutionContextAllocationStrategy,
    Logger,
    TensorIOMode,
    nptype,
    report,
)

if TYPE_CHECKING:
    from tests.support.trt_emulator.shapes import EngineModel
    from tests.support.trt_emulator.tensorrt_module import TrtEnv

_SEV = Logger


class Runtime:
    _env: TrtEnv

    def __init__(self, logger: Any) -> None:
        self._logger = logger

    def deserialize_cuda_engine(self, serialized_engine: Any) -> ICudaEngine | None:
        env = self._env
        parsed = planfmt.parse(bytes(serialized_engine))
        if parsed is None:
            report(self._logger, _SEV.ERROR, "IRuntime::deserializeCudaEngine: Error Code 1: Serialization "
                   "(Serialization assertion magicTagRead == kMAGIC_TAG failed.Magic tag does not match)", env.journal)
            return None
        header, onnx_bytes = parsed
        if header.tensorrt != env.full_version:
            # developer guide, "Version Compatibility": by default an engine runs only with the TensorRT
            # version that built it
            report(self._logger, _SEV.ERROR, "IRuntime::deserializeCudaEngine: Error Code 6: API Usage Error "
                   f"(The engine plan file is not compatible with this version of TensorRT, expecting library "
                   f"version {env.full_version} got {header.tensorrt}, please rebuild.)", env.journal)
            return None
        if list(header.compute_capability) != list(env.gpu.compute_capability):
            # "Hardware Compatibility": by default an engine runs only on the compute capability it was built for
            report(self._logger, _SEV.ERROR, "IRuntime::deserializeCudaEngine: Error Code 1: Serialization "
                   f"(the engine was built for compute capability {header.compute_capability}, this GPU has "
                   f"{list(env.gpu.compute_capability)})", env.journal)
            return None
        if header.gpu != env.gpu.name:
            # GUESS: same compute capability, other GPU model: TensorRT warns and loads
            report(self._logger, _SEV.WARNING, "Using an engine plan file across different models of devices is "
                   "not recommended and is likely to affect performance or even cause errors.", env.journal)
        try:
            weights = env.machine.alloc(max(header.weights_bytes, 1), "deserializeCudaEngine") \
                if env.runtime_context() else 0
        except CudaError as exc:
            report(self._logger, _SEV.ERROR, f"deserializeCudaEngine: out of device memory ({exc})", env.journal)
            return None
        return ICudaEngine(env, self._logger, header, env.engine_model(onnx_bytes), weights, bytes(serialized_engine))


class ICudaEngine:
    def __init__(self, env: TrtEnv, logger: Any, header: planfmt.PlanHeader, model: EngineModel, weights: int,
                 plan: bytes) -> None:
        self._env, self._logger, self.header, self.model = env, logger, header, model
        self._plan = plan
        self._io = {t.name: t for t in header.io}
        self._order = [t.name for t in header.io]
        self.name = "emulated engine"
        finalizer(self, env.machine.release, weights)

    def _log(self, sev: Any, msg: str) -> None:
        report(self._logger, sev, msg, self._env.journal)

    def _tensor(self, name: str, what: str) -> planfmt.TensorInfo | None:
        t = self._io.get(name)
        if t is None:
            self._log(_SEV.ERROR, f"ICudaEngine::{what}: Error Code 3: API Usage Error (no tensor named {name})")
        return t

    @property
    def num_io_tensors(self) -> int:
        return len(self._order)

    def get_tensor_name(self, index: int) -> str:
        return self._order[index]

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        t = self._tensor(name, "getTensorIOMode")
        return TensorIOMode.NONE if t is None else (TensorIOMode.INPUT if t.is_input else TensorIOMode.OUTPUT)

    def get_tensor_dtype(self, name: str) -> DataType:
        t = self._tensor(name, "getTensorDataType")
        return DataType.FLOAT if t is None else DataType(t.dtype)

    def get_tensor_shape(self, name: str) -> Dims:
        t = self._tensor(name, "getTensorShape")
        return Dims() if t is None else Dims(t.shape)

    def is_shape_inference_io(self, name: str) -> bool:
        return False  # GUESS/limit: the emulator has no shape tensors (docs/tensorrt-emulator.md)

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.header.profiles)

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[Dims]:
        t = self._tensor(name, "getProfileShape")
        if t is None or not t.is_input or not 0 <= profile_index < len(self.header.profiles):
            self._log(_SEV.ERROR, f"getProfileShape({name}, {profile_index}): not an input or no such profile")
            return []
        return [Dims(d) for d in self.header.profiles[profile_index][name]]

    def get_tensor_profile_values(self, profile_index: int, name: str) -> list[list[int]]:
        # Engine.html: "If the specified binding is not an input shape binding, an exception is raised."
        raise RuntimeError(f"{name} is not an input shape binding")

    @property
    def device_memory_size_v2(self) -> int:
        return self.header.activation_bytes

    @property
    def device_memory_size(self) -> int:
        return self.header.activation_bytes

    def serialize(self) -> bytes:
        return self._plan

    def create_execution_context(self, strategy: ExecutionContextAllocationStrategy =
                                 ExecutionContextAllocationStrategy.STATIC) -> IExecutionContext | None:
        strategy = ExecutionContextAllocationStrategy(strategy)
        scratch = 0
        if strategy != ExecutionContextAllocationStrategy.USER_MANAGED:
            # STATIC: "Default static allocation with the maximum size across all profiles" (made now)
            try:
                self._env.runtime_context()
                scratch = self._env.machine.alloc(max(self.header.activation_bytes, 1), "createExecutionContext")
            except CudaError as exc:
                self._log(_SEV.ERROR, f"createExecutionContext: out of device memory ({exc})")
                return None
        return IExecutionContext(self, strategy, scratch)


def _volume(shape: tuple[int, ...]) -> int:
    return int(math.prod(shape)) if shape else 1


class IExecutionContext:
    def __init__(self, engine: ICudaEngine, strategy: ExecutionContextAllocationStrategy, scratch: int) -> None:
        self.engine = engine
        self._env = engine._env
        self.strategy = strategy
        self._own_scratch = scratch
        self._device_memory: tuple[int, int] | None = (scratch, engine.header.activation_bytes) if scratch else None
        self._profile = 0  # "The newly created execution context will be assigned optimization profile 0"
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._addresses: dict[str, int] = {}
        self._needs_plain_enqueue = True  # deferred setup runs on the first enqueue after a shape/profile change
        self._busy = threading.Lock()
        self.name = ""
        if scratch:
            finalizer(self, self._env.machine.release, scratch)

    def _log(self, sev: Any, msg: str) -> None:
        self.engine._log(sev, msg)

    def _enter(self, what: str) -> bool:
        """An execution context is not thread-safe (developer guide, "Thread Safety": TensorRT objects may
        be used from several threads only with one execution context per thread at a time): a call that
        overlaps another thread's call on the same context is recorded as an error and fails."""
        if self._busy.acquire(blocking=False):
            return True
        self._env.machine.errors.append(f"IExecutionContext.{what} while another thread uses the same context")
        return self._fail(f"IExecutionContext::{what}: the context is in use by another thread")

    def _fail(self, msg: str) -> bool:
        self._log(_SEV.ERROR, msg)
        return False

    @property
    def active_optimization_profile(self) -> int:
        return self._profile

    def set_optimization_profile_async(self, profile_index: int, stream_handle: int) -> bool:
        if not self._enter("set_optimization_profile_async"):
            return False
        try:
            return self._set_optimization_profile_async(profile_index, stream_handle)
        finally:
            self._busy.release()

    def _set_optimization_profile_async(self, profile_index: int, stream_handle: int) -> bool:
        if not 0 <= profile_index < self.engine.num_optimization_profiles:
            return self._fail(f"setOptimizationProfileAsync: profile {profile_index} out of range "
                              f"[0, {self.engine.num_optimization_profiles})")
        if profile_index != self._profile:
            # ExecutionContext.html, active_optimization_profile: changing it "will invalidate all dynamic
            # bindings for the current execution context, so that they have to be set again"
            self._profile = profile_index
            self._shapes.clear()
            self._needs_plain_enqueue = True
        return True

    def set_input_shape(self, name: str, shape: Any) -> bool:
        if not self._enter("set_input_shape"):
            return False
        try:
            return self._set_input_shape(name, shape)
        finally:
            self._busy.release()

    def _set_input_shape(self, name: str, shape: Any) -> bool:
        t = self.engine._io.get(name)
        if t is None or not t.is_input:
            return self._fail(f"IExecutionContext::setInputShape: Error Code 3: API Usage Error ({name} is not an "
                              "input tensor of the engine)")
        dims = tuple(int(d) for d in shape)
        lo, _, hi = self.engine.header.profiles[self._profile][name]
        ok = len(dims) == len(lo) and all(a <= d <= b for a, d, b in zip(lo, dims, hi, strict=False))
        if not ok:
            # C++ setInputShape: "false if ... dimensions are out of the bounds of the current profile"
            return self._fail(f"IExecutionContext::setInputShape: Error Code 3: API Usage Error (Parameter check "
                              f"failed, condition: satisfyProfile. Set dimension {list(dims)} for tensor {name} "
                              f"does not satisfy any optimization profiles. Valid range for profile "
                              f"{self._profile}: {lo}..{hi}.)")
        if self._shapes.get(name) != dims:
            self._shapes[name] = dims
            self._needs_plain_enqueue = True
        return True

    def _inputs_specified(self) -> bool:
        return all(t.name in self._shapes or all(d >= 0 for d in t.shape)
                   for t in self.engine.header.io if t.is_input)

    @property
    def all_input_dimensions_specified(self) -> bool:
        return self._inputs_specified()

    def _input_shapes(self) -> dict[str, tuple[int, ...]]:
        return {t.name: self._shapes.get(t.name, tuple(t.shape)) for t in self.engine.header.io if t.is_input}

    def get_tensor_shape(self, name: str) -> Dims:
        t = self.engine._io.get(name)
        if t is None:
            self._log(_SEV.ERROR, f"getTensorShape: no tensor named {name}")
            return Dims()
        if t.is_input:
            return Dims(self._shapes.get(name, tuple(t.shape)))
        if not self._inputs_specified():
            return Dims(t.shape)  # GUESS: unresolved output dimensions stay -1 until every input shape is set
        return Dims(self.engine.model.output_shapes(self._input_shapes())[name])

    def set_tensor_address(self, name: str, memory: int) -> bool:
        if not self._enter("set_tensor_address"):
            return False
        try:
            return self._set_tensor_address(name, memory)
        finally:
            self._busy.release()

    def _set_tensor_address(self, name: str, memory: int) -> bool:
        if name not in self.engine._io:
            return self._fail(f"IExecutionContext::setTensorAddress: Error Code 3: API Usage Error (no tensor named "
                              f"{name})")
        if int(memory) % 256:
            # C++ IExecutionContext::setTensorAddress: "The pointer must have at least 256-byte alignment"
            # (setInputTensorAddress: returns false when the pointer "does not meet alignment requirements")
            return self._fail(f"IExecutionContext::setTensorAddress: Error Code 3: API Usage Error ({name}: address "
                              f"{int(memory):#x} is not 256-byte aligned)")
        self._addresses[name] = int(memory)
        return True

    def get_tensor_address(self, name: str) -> int:
        return self._addresses.get(name, 0)

    def set_device_memory(self, memory: int, size: int) -> None:
        need = self.engine.header.activation_bytes
        if size < need:
            # set_device_memory: "size ... must be at least as large as CudaEngine.get_device_memory_size_v2"
            self._log(_SEV.ERROR, f"setDeviceMemoryV2: size {size} is smaller than device_memory_size_v2 {need}")
            return
        if int(memory) % 256:
            self._log(_SEV.ERROR, "setDeviceMemoryV2: the memory must be 256-byte aligned")  # set_device_memory doc
            return
        self._device_memory = (int(memory), int(size))

    def execute_async_v3(self, stream_handle: int) -> bool:
        if not self._enter("execute_async_v3"):
            return False
        try:
            return self._execute_async_v3(stream_handle)
        finally:
            self._busy.release()

    def _execute_async_v3(self, stream_handle: int) -> bool:
        env, eng = self._env, self.engine
        if not self._inputs_specified():
            missing = [t.name for t in eng.header.io if t.is_input and t.name not in self._shapes
                       and any(d < 0 for d in t.shape)]
            return self._fail(f"IExecutionContext::enqueueV3: Error Code 3: API Usage Error (input shapes not "
                              f"specified: {missing})")
        if self._device_memory is None:
            return self._fail("IExecutionContext::enqueueV3: Error Code 3: API Usage Error (USER_MANAGED context "
                              "without device memory: call set_device_memory first)")
        shapes = self._input_shapes()
        shapes.update(eng.model.output_shapes(shapes))
        bound: dict[str, tuple[int, tuple[int, ...], np.dtype]] = {}
        for t in eng.header.io:
            addr = self._addresses.get(t.name)
            if not addr:
                return self._fail(f"IExecutionContext::enqueueV3: Error Code 3: API Usage Error (Parameter check "
                                  f"failed, condition: address is set. Address is not set for "
                                  f"{'input' if t.is_input else 'output'} tensor {t.name}. Call setInputTensorAddress "
                                  "or setTensorAddress before enqueue/execute.)")
            dtype = np.dtype(nptype(DataType(t.dtype)))
            nbytes = _volume(shapes[t.name]) * dtype.itemsize
            if env.machine.find(addr, nbytes) is None:
                # Real TensorRT cannot see buffer sizes: a short buffer is an illegal address or silent
                # corruption on the GPU. The emulator refuses at enqueue (GUESS on the symptom).
                return self._fail(f"enqueueV3: tensor {t.name} {shapes[t.name]} needs {nbytes} bytes at {addr:#x}, "
                                  "which is not inside one live device allocation")
            bound[t.name] = (addr, shapes[t.name], dtype)
        scratch = self._device_memory
        if scratch[0] and env.machine.find(scratch[0], eng.header.activation_bytes) is None:
            return self._fail("enqueueV3: the context's device memory is not a live allocation")
        try:
            capture = env.machine.capturing(int(stream_handle))
        except CudaError as exc:
            return self._fail(f"enqueueV3: {exc}")
        if capture is not None and self._needs_plain_enqueue:
            # developer guide, CUDA Graphs: after changing shapes (and on a new context) call enqueueV3 once
            # before capturing, so deferred updates are not part of the capture
            env.machine.invalidate_capture(int(stream_handle), "enqueueV3 with pending shape-dependent setup")
            return self._fail("IExecutionContext::enqueueV3: Error Code 1: Cuda Runtime (operation not permitted "
                              "when stream is capturing): call execute_async_v3 once before capturing")
        self._needs_plain_enqueue = False
        model, machine = eng.model, env.machine
        outputs = [t.name for t in eng.header.io if not t.is_input]

        def run() -> None:
            feeds = {}
            for t in eng.header.io:
                if t.is_input:
                    addr, shape, dtype = bound[t.name]
                    raw = machine.span(addr, _volume(shape) * dtype.itemsize, f"enqueueV3 input {t.name}")
                    feeds[t.name] = raw.copy().view(dtype).reshape(shape)
            if scratch[0]:
                machine.span(scratch[0], eng.header.activation_bytes, "enqueueV3 activation memory")
            results = model.run(feeds, outputs)
            for name, value in zip(outputs, results, strict=False):
                addr, shape, dtype = bound[name]
                if tuple(value.shape) != tuple(shape):
                    env.machine.errors.append(f"emulator: output {name} came out {value.shape}, predicted {shape}")
                    raise CudaError(999, f"output {name} shape differs from the prediction")
                out = np.ascontiguousarray(value, dtype=dtype).reshape(-1).view(np.uint8)
                machine.span(addr, out.nbytes, f"enqueueV3 output {name}")[...] = out

        env.runtime_context()  # TensorRT launches through the CUDA runtime, which binds the primary context
        try:
            machine.enqueue(int(stream_handle), Op("enqueueV3", run))
        except CudaError as exc:
            return self._fail(f"enqueueV3: {exc}")
        return True

