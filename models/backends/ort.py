"""ONNX Runtime backend."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort
from cosyedge_models.backends import ort_trt
from cosyedge_models.backends.base import DecodeLoop, HostDecodeLoop, Session
from cosyedge_models.backends.fixed_shapes import fixed_shape_names, fixed_shapes_wanted
from cosyedge_models.backends.flow_cache import HostStepCache, StepCache, StepCacheSpec
from cosyedge_models.backends.ort_cache import BoundCacheFactory
from cosyedge_models.backends.profiling import profile_dir
from cosyedge_models.backends.shared_weights import SharedWeights, SharedWeightsRegistry
from cosyedge_models.bundle.loader import BATCHED_PREFIXES, FIXED_SHAPE_PREFIXES, Bundle
from cosyedge_models.errors import BundleError, SynthesisError

log = logging.getLogger(__name__)


# Stages whose CUDA sessions capture CUDA graphs (fixed shapes, run through IOBinding only).
CUDA_GRAPH_STAGES = ("llm_decode_static",)


def cudnn_options() -> dict[str, str]:
    """The CUDA provider's cuDNN settings. HEURISTIC by default: the default
    exhaustive search re-benchmarks every conv for each new sequence length,
    and lengths change per request here. COSYEDGE_ORT_CUDNN_SEARCH
    (HEURISTIC, EXHAUSTIVE, DEFAULT) and COSYEDGE_ORT_CONV1D_PAD_NC1D=1 override
    it, to measure (edge_build/tools/device_probe.py compares them per stage)."""
    search = os.environ.get("COSYEDGE_ORT_CUDNN_SEARCH", "HEURISTIC").upper()
    if search not in ("HEURISTIC", "EXHAUSTIVE", "DEFAULT"):
        raise BundleError(f"COSYEDGE_ORT_CUDNN_SEARCH={search!r}: allowed values: HEURISTIC, EXHAUSTIVE, DEFAULT")
    options = {"cudnn_conv_algo_search": search}
    if os.environ.get("COSYEDGE_ORT_CONV1D_PAD_NC1D") == "1":
        options["cudnn_conv1d_pad_to_nc1d"] = "1"
    return options


def _device_values(arrays: dict[str, np.ndarray], device_id: int) -> dict[str, ort.OrtValue]:
    """One device copy of each shared weight, as a view that onnxruntime does
    not own: add_initializer refuses a buffer that onnxruntime allocated
    ("must be owned by the user"), and a DLPack view of it is not (the view
    keeps its source alive)."""
    return {k: ort.OrtValue.from_dlpack(ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v), "cuda", device_id))
            for k, v in arrays.items()}


def shares_weights(providers: Sequence[str]) -> bool:
    """Whether sessions on these providers take a bundle's shared weights: the CPU and CUDA
    providers (host or device buffers); TensorRT's provider builds engines with their own
    copy. COSYEDGE_ORT_SHARE_WEIGHTS=0: one copy per session (to compare)."""
    on = bool(providers) and providers[0] in ("CPUExecutionProvider", "CUDAExecutionProvider")
    return on and os.environ.get("COSYEDGE_ORT_SHARE_WEIGHTS", "1") != "0"


class OrtSession:
    def __init__(self, name: str, path: Path, providers: Sequence[str], device_id: int, threads: int | None,
                 cuda_graph: bool = False, shared: SharedWeights | None = None,
                 registry: SharedWeightsRegistry | None = None, cpu_memory_arena: bool = False,
                 trt_options: Mapping[str, str] | None = None) -> None:
        opts = ort.SessionOptions()
        self._shared, self._registry = shared, registry
        self._counts_shared = False
        if shared is not None:
            # The same buffers for every session of the LLM (one copy of the
            # weights): host buffers over the mapped file on the CPU provider,
            # device buffers on the CUDA provider (onnxruntime uses a user-supplied
            # initializer in place when it lives on the device the graph plans it
            # on). Prepacking would give each session its own packed copy of
            # every MatMul weight, so it is off for these sessions.
            if not shared.values:
                # (a CPU-only onnxruntime runs an ort-cuda bundle on the CPU: host buffers there)
                cuda = providers[0] == "CUDAExecutionProvider" and "CUDAExecutionProvider" in \
                    ort.get_available_providers()
                shared.values.update(_device_values(shared.arrays, device_id) if cuda else
                                     {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in shared.arrays.items()})
                self._counts_shared = True
            for key, value in shared.values.items():
                opts.add_initializer(key, value)
            opts.add_session_config_entry("session.disable_prepacking", "1")
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        # Idle intra-op workers spin by default. Streaming runs the LLM and the
        # flow/vocoder sessions at the same time (stage overlap, batching), and
        # spinning pools then take the cores from each other; measured at full
        # size on 2 cores it made the overlapped flow 2.6x slower. Off unless
        # COSYEDGE_ORT_SPINNING=1.
        spinning = os.environ.get("COSYEDGE_ORT_SPINNING", "0") == "1"
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
        # onnxruntime's CPU arena keeps the peak of every run for the process's life
        # (measured at full size: +300-450 MB after one request, +1.8 GiB after a long
        # offline one) for 2-6% of speed; off, host tensors are freed as they go (docs/memory.md)
        opts.enable_cpu_mem_arena = cpu_memory_arena
        profiles = profile_dir()
        if profiles is not None:  # models/tools/ort_profile.py sums these traces
            profiles.mkdir(parents=True, exist_ok=True)
            opts.enable_profiling = True
            opts.profile_file_prefix = str(profiles / name)
        self._profiling = profiles is not None
        available = set(ort.get_available_providers())
        chosen: list[str | tuple[str, dict[str, str]]] = []
        for p in providers:
            if p not in available:
                continue
            if p == "CUDAExecutionProvider":
                options = {"device_id": str(device_id), **cudnn_options()}
                if cuda_graph:
                    options["enable_cuda_graph"] = "1"
                chosen.append((p, options))
            elif p == ort_trt.PROVIDER:
                chosen.append((p, dict(trt_options or {"device_id": str(device_id)})))
            else:
                chosen.append(p)
        if not chosen:
            raise BundleError(
                f"none of the ONNX Runtime providers {list(providers)} is available here "
                f"(available: {sorted(available)})"
            )
        try:
            self._sess = ort.InferenceSession(str(path), sess_options=opts, providers=chosen)
        except Exception as exc:  # onnxruntime raises its own exception types
            self._release_shared()
            raise BundleError(f"cannot load {path}: {exc}") from exc
        self.name = name
        self.path = path
        self.device_id = device_id
        self.input_names = tuple(i.name for i in self._sess.get_inputs())
        self.output_names = tuple(o.name for o in self._sess.get_outputs())
        self.providers = tuple(self._sess.get_providers())
        self.input_shapes = {i.name: tuple(i.shape) for i in self._sess.get_inputs()}
        self.output_shapes = {o.name: tuple(o.shape) for o in self._sess.get_outputs()}
        # the declared element types, onnxruntime's spelling: "tensor(float)", "tensor(float16)"
        self.input_types = {i.name: str(i.type) for i in self._sess.get_inputs()}
        self.output_types = {o.name: str(o.type) for o in self._sess.get_outputs()}
        self.cuda_graph = cuda_graph and self.providers[0] == "CUDAExecutionProvider"
        self._closed = False

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        names = list(outputs) if outputs is not None else list(self.output_names)
        try:
            values = self._sess.run(names, dict(inputs))
        except Exception as exc:
            raise SynthesisError(f"{self.name}: onnxruntime failed: {exc}") from exc
        return dict(zip(names, values, strict=True))

    def io_binding(self) -> ort.IOBinding:
        return self._sess.io_binding()

    def run_bound(self, binding: ort.IOBinding, run_options: ort.RunOptions | None = None) -> None:
        try:
            self._sess.run_with_iobinding(binding, run_options)
        except Exception as exc:
            raise SynthesisError(f"{self.name}: onnxruntime failed: {exc}") from exc

    @property
    def on_device(self) -> bool:
        """True when the graph runs on a GPU provider (its tensors can stay there)."""
        return self.providers[0] in ("CUDAExecutionProvider", ort_trt.PROVIDER)

    def memory_bytes(self) -> int:
        # Weights dominate; the arena is not exposed by onnxruntime's Python API.
        # Shared weights count once: with the session that mapped them.
        size = self.path.stat().st_size
        data = self.path.with_name(self.path.name + ".data")
        shared = self._shared.nbytes if self._shared is not None and self._counts_shared else 0
        return size + (data.stat().st_size if data.exists() else 0) + shared

    @property
    def cpu_memory_arena(self) -> bool:
        """Whether onnxruntime's CPU arena holds this session's host tensors (as the session reports it)."""
        return bool(self._sess.get_session_options().enable_cpu_mem_arena)

    @property
    def shares_weights(self) -> bool:
        return self._shared is not None

    def _release_shared(self) -> None:
        if self._shared is not None and self._registry is not None:
            self._registry.release(self._shared)
        self._shared = None

    def close(self) -> None:
        """Release the session (twice: once; a stage that gave up its sessions early, then the engine)."""
        if self._closed:
            return
        self._closed = True
        if self._profiling:
            log.info("%s: onnxruntime profile %s", self.name, self._sess.end_profiling())
            self._profiling = False
        del self._sess
        self._release_shared()


class OrtBackend:
    def __init__(self, providers: Sequence[str], device_id: int = 0, cpu_memory_arena: bool = False,
                 trt_stages: ort_trt.TrtStages | None = None) -> None:
        """`trt_stages`: the bundle's stages, for the TensorRT provider's options (ort-trt)."""
        if ort_trt.PROVIDER in providers and trt_stages is None:
            raise ValueError("the TensorRT execution provider needs the bundle's stages (trt_stages)")
        self._trt = trt_stages
        self.providers = tuple(providers)
        self.device_id = device_id
        self.cpu_memory_arena = cpu_memory_arena  # SynthesisSettings.cpu_memory_arena
        self.name = "ort" if self.providers == ("CPUExecutionProvider",) else "ort-" + self.providers[0].removesuffix(
            "ExecutionProvider").lower()
        self._device_caches = BoundCacheFactory("cuda", device_id)
        self._shared = SharedWeightsRegistry()

    def load(self, stage: str, path: Path, *, threads: int | None = None) -> OrtSession:
        if threads is None:
            env = os.environ.get("COSYEDGE_ORT_THREADS")
            threads = int(env) if env else None
        # COSYEDGE_ORT_CUDA_GRAPH=0: run the static step without capture (to compare)
        graph = (stage in CUDA_GRAPH_STAGES or stage.startswith((*FIXED_SHAPE_PREFIXES, *BATCHED_PREFIXES))) and \
            os.environ.get("COSYEDGE_ORT_CUDA_GRAPH", "1") != "0"
        shared = self._shared.for_graph(path) if shares_weights(self.providers) else None
        trt_options = None
        if self._trt is not None:
            trt_options = ort_trt.provider_options(self._trt.stage(stage), bundle_root=self._trt.root,
                                                   device_id=self.device_id, cuda_graph=graph)
        return OrtSession(stage, path, self.providers, self.device_id, threads, cuda_graph=graph, shared=shared,
                          registry=self._shared, cpu_memory_arena=self.cpu_memory_arena, trt_options=trt_options)

    def decode_loop(self, prefill: Session, decode: Session) -> DecodeLoop:
        if isinstance(prefill, OrtSession) and isinstance(decode, OrtSession) and decode.on_device:
            return BoundDecodeLoop(prefill, decode, "cuda", self.device_id)
        return HostDecodeLoop(prefill, decode)

    def flow_cache(self, estimator: Session, spec: StepCacheSpec) -> StepCache:
        # On a GPU provider the caches stay in device memory (no cache copy per
        # call); on the CPU host arrays are already where the graph computes.
        if isinstance(estimator, OrtSession) and estimator.on_device:
            return self._device_caches(estimator, spec)
        return HostStepCache(estimator, spec)

    def describe(self) -> dict[str, str]:
        return {
            "backend": self.name,
            "onnxruntime": ort.__version__,
            "providers": ",".join(p for p in self.providers if p in ort.get_available_providers()),
            "device": ort.get_device(),
            "cpu_memory_arena": "on" if self.cpu_memory_arena else "off",
        }


def bound_lm_run(session: OrtSession, embeds: np.ndarray, past: ort.OrtValue | np.ndarray | None, past_len: int,
                 device: tuple[str, int], attention_mask: np.ndarray | None = None) -> tuple[np.ndarray, ort.OrtValue]:
    """One LLM prefill (past None) or decode run through IOBinding: the
    embeddings go in from the host, the log-probabilities come back to it,
    the cache stays a runtime tensor on `device`. `past` is the previous
    run's device tensor, or a host array (a voice's saved prefix: copied to
    the device for this run, ~24 KiB per position at full size).
    `attention_mask` [B, past_len + T] (default: all ones): 0 for padding.
    Returns (logp, present_kv)."""
    mask = (attention_mask if attention_mask is not None
            else np.ones((embeds.shape[0], past_len + embeds.shape[1]), np.int64))
    binding = session.io_binding()
    binding.bind_cpu_input("inputs_embeds", np.ascontiguousarray(embeds, dtype=np.float32))
    binding.bind_cpu_input("attention_mask", np.ascontiguousarray(mask, dtype=np.int64))
    if isinstance(past, np.ndarray):
        binding.bind_cpu_input("past_kv", np.ascontiguousarray(past))
    elif past is not None:
        binding.bind_ortvalue_input("past_kv", past)
    binding.bind_output("logp", "cpu")
    binding.bind_output("present_kv", device[0], device[1])
    session.run_bound(binding)
    logp, kv = binding.get_outputs()
    return np.asarray(logp.numpy()), kv


class BoundDecodeLoop:
    """DecodeLoop over ONNX Runtime IOBinding: the KV cache that one step
    returns is bound, as the runtime's own device tensor, as the next step's
    input, so it never crosses to the host; only the embeddings go in and the
    log-probabilities come out (a few KB per token). On the CPU provider it
    runs the same way with device_type "cpu" (that is how it is tested here)."""

    takes_past = True

    def __init__(self, prefill: OrtSession, decode: OrtSession, device_type: str, device_id: int = 0) -> None:
        self._prefill = prefill
        self._decode = decode
        self._device = (device_type, device_id)
        self._kv: ort.OrtValue | None = None
        self._len = 0

    def _run(self, session: OrtSession, embeds: np.ndarray, past: ort.OrtValue | np.ndarray | None) -> np.ndarray:
        logp, self._kv = bound_lm_run(session, embeds, past, self._len, self._device)
        self._len = int(self._kv.shape()[4])
        return logp

    def prefill(self, inputs_embeds: np.ndarray, past: np.ndarray | None = None) -> np.ndarray:
        self._len = 0 if past is None else int(past.shape[4])
        return self._run(self._prefill if past is None else self._decode, inputs_embeds, past)

    def step(self, inputs_embeds: np.ndarray) -> np.ndarray:
        if self._kv is None:
            raise RuntimeError("step() before prefill()")
        return self._run(self._decode, inputs_embeds, self._kv)

    @property
    def cache_len(self) -> int:
        return self._len

    def close(self) -> None:
        self._kv = None
        self._len = 0


def fixed_shape_sessions(bundle: Bundle, backend_name: str, load: Callable[[str], Session], setting: bool | None,
                         prefix: str, what: str) -> tuple[list[OrtSession], tuple[str, int]] | None:
    """The bundle's fixed-shape graphs named `prefix`..., loaded, with the
    device they run on, or None (off). `setting`: None auto (on for ort-cuda
    when the bundle has them), True on (an error without them; on the CPU
    without capture), False off. `what` names the setting and the export
    option in that error."""
    names = fixed_shape_names(bundle.stages, prefix)
    if not (fixed_shapes_wanted(names, setting, backend_name, bundle.root, what) and backend_name.startswith("ort")):
        return None
    sessions = [load(n) for n in names]
    ort_sessions = [s for s in sessions if isinstance(s, OrtSession)]
    if len(ort_sessions) != len(sessions):
        return None  # a wrapped backend (tests): the dynamic graphs
    return ort_sessions, (("cuda", ort_sessions[0].device_id) if ort_sessions[0].on_device else ("cpu", 0))
