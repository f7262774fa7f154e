"""Streaming flow encoder calls as CUDA graphs on onnxruntime's CUDA
provider, over the fixed-shape graphs of edge_build/export/flow_encoder_static.py.

The dynamic encoder runs once per streaming chunk with ~200 of its ~980
nodes on the CPU and 14 host/device copies a call, and takes its caches
from the host each time: onnxruntime cannot capture it. The static graphs
have one window size each (tokens, a bucket) over caches of a fixed number
of tokens whose first `cached_len` rows are the committed ones, so every call
of one (slot, window) pair has the same shapes and addresses and replays as
one graph launch, as the estimator's do (ort_static_flow.py, whose plan this
follows): an `EncoderSlot` is one request's device buffers (both stacks'
K/V, both conv histories) with one graph id per window, borrowed by a
`StaticEncoderCache` for the request's life; every run happens on the
engine's GraphThread (captured there at load, before any request); a call is
inputs in, replay, the committed rows appended by device-to-device copy, mu
and spks out.

A window longer than the largest bucket, or caches that outgrow the slot,
move the request (once: the rows read back) to the host caches over the
dynamic graph; requests beyond the pool use those from the start. On the CPU
the same code runs without capture (that is how it is tested)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import onnxruntime as ort
from cosyedge_models.backends.base import Session
from cosyedge_models.backends.encoder_cache import (
    EncoderCache,
    EncoderCacheSpec,
    EncoderCall,
    EncoderPrefix,
    HostEncoderCache,
    PooledEncoderCache,
)
from cosyedge_models.backends.fixed_shapes import SlotPool
from cosyedge_models.backends.graph_thread import CAPTURE_RUNS, GraphThread
from cosyedge_models.backends.ort import OrtSession, fixed_shape_sessions
from cosyedge_models.backends.ort_cache import DeviceCopier, copy_prefix, device_zeros
from cosyedge_models.backends.ort_static_flow import capture_slots
from cosyedge_models.bundle.loader import STATIC_ENCODER_PREFIX, Bundle
from cosyedge_models.errors import BundleError

log = logging.getLogger(__name__)

_INT_INPUTS = ("token", "token_len", "lookahead_len", "cached_len", "commit_tokens")
_OUTPUTS = ("mu", "spks", "enc_window", "up_window", "pre_cache_new", "upconv_cache_new")
GRAPH_ID_BASE = 100_000  # apart from the other stages' ids, whether onnxruntime keys them per session or not


class _WindowIO:
    """The inputs and outputs of one window size's graph, bound by every slot."""

    def __init__(self, session: OrtSession, device: tuple[str, int]) -> None:
        self.session = session
        self.window = int(session.input_shapes["token"][1])
        self.inputs = {name: device_zeros(session.input_shapes[name], np.int64 if name in _INT_INPUTS else np.float32,
                                    device)
                       for name in (*_INT_INPUTS, "embedding")}
        self.outputs = {name: device_zeros(session.output_shapes[name], np.float32, device) for name in _OUTPUTS}


class EncoderSlot:
    """One request's encoder buffers (zeroed: free rows are masked, never NaN) and its
    graph ids, one per window size."""

    def __init__(self, index: int, graphs: StaticEncoderGraphs) -> None:
        spec = graphs.spec
        self.enc = device_zeros((graphs.cache_tokens, *spec.enc_row), np.float32, graphs.device)
        self.up = device_zeros((graphs.cache_tokens * spec.token_mel_ratio, *spec.up_row), np.float32, graphs.device)
        self.pre = device_zeros(spec.pre_shape, np.float32, graphs.device)
        self.upconv = device_zeros(spec.upconv_shape, np.float32, graphs.device)
        self.bindings: list[ort.IOBinding] = []
        self.run_options: list[ort.RunOptions] = []
        for w, io in enumerate(graphs.io):
            binding = io.session.io_binding()
            for name, value in io.inputs.items():
                binding.bind_ortvalue_input(name, value)
            for name, value in (("enc_cache", self.enc), ("up_cache", self.up), ("pre_cache", self.pre),
                                ("upconv_cache", self.upconv)):
                binding.bind_ortvalue_input(name, value)
            for name, value in io.outputs.items():
                binding.bind_ortvalue_output(name, value)
            self.bindings.append(binding)
            options = ort.RunOptions()
            if graphs.capture:  # one captured graph per slot and window size
                options.add_run_config_entry("gpu_graph_id", str(GRAPH_ID_BASE + index * len(graphs.io) + w))
            self.run_options.append(options)

    def nbytes(self) -> int:
        return sum(int(np.prod(v.shape())) * 4 for v in (self.enc, self.up, self.pre, self.upconv))


class StaticEncoderGraphs(SlotPool[EncoderSlot]):
    """The fixed-shape encoder sessions of one engine and their slot pool (one slot per
    request), run on `thread`. `__call__` is an EncoderCacheFactory."""

    def __init__(self, sessions: Sequence[OrtSession], device: tuple[str, int], copier: DeviceCopier,
                 spec: EncoderCacheSpec, max_slots: int, thread: GraphThread) -> None:
        if not sessions:
            raise ValueError("no fixed-shape encoder graphs")
        super().__init__(max_slots, thread)
        self.device = device
        self.copier = copier
        self.spec = spec
        self.io = sorted((_WindowIO(s, device) for s in sessions), key=lambda io: io.window)
        self.windows = [io.window for io in self.io]
        self.cache_tokens = int(sessions[0].input_shapes["enc_cache"][0])
        self.capture = all(s.cuda_graph for s in sessions)

    def warm_up(self) -> None:
        """On the graph thread, before any request: every slot, and each of its graphs run
        CAPTURE_RUNS times (onnxruntime captures on the last). A refusal disables them."""
        self.thread.call(self._warm_up)

    def _warm_up(self) -> None:
        runs = CAPTURE_RUNS if self.capture else 1
        while self.slot_count < self.max_slots:
            self.register(EncoderSlot(self.slot_count, self))
        capture_slots(self, [io.session for io in self.io], runs, "fixed-shape flow encoder graphs")

    def __call__(self, session: Session, spec: EncoderCacheSpec) -> EncoderCache:
        # the graphs bake in this bundle's chunk and shapes
        slot = self.take_slot() if spec == self.spec and self.disabled is None else None
        if slot is None:
            return HostEncoderCache(session, spec)
        return StaticEncoderCache(self, slot, session)

    def close(self) -> None:
        self.drop_slots()


class StaticEncoderCache(PooledEncoderCache[EncoderSlot]):
    """EncoderCache on an EncoderSlot; moves to a HostEncoderCache over the dynamic graph
    when a call does not fit the fixed shapes."""

    def __init__(self, graphs: StaticEncoderGraphs, slot: EncoderSlot, dynamic: Session) -> None:
        super().__init__(graphs, slot, dynamic, graphs.spec)
        self._graphs = graphs

    def _replay(self, slot: EncoderSlot, call: EncoderCall) -> tuple[np.ndarray, np.ndarray]:
        return _replay(self._graphs, slot, call)

    def _read_back(self, slot: EncoderSlot, tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        r = self.spec.token_mel_ratio
        return (slot.enc.numpy()[:tokens].copy(), slot.up.numpy()[: r * tokens].copy(), slot.pre.numpy().copy(),
                slot.upconv.numpy().copy())

    def _seed(self, slot: EncoderSlot, prefix: EncoderPrefix) -> None:
        graphs = self._graphs
        for rows, dst in ((prefix.enc, slot.enc), (prefix.up, slot.up)):
            copy_prefix(graphs.copier, int(dst.data_ptr()), rows, np.float32)
        slot.pre.update_inplace(np.ascontiguousarray(prefix.pre, np.float32))
        slot.upconv.update_inplace(np.ascontiguousarray(prefix.upconv, np.float32))

    def _reset(self, slot: EncoderSlot) -> None:
        slot.pre.update_inplace(np.zeros(self.spec.pre_shape, np.float32))
        slot.upconv.update_inplace(np.zeros(self.spec.upconv_shape, np.float32))


def _replay(graphs: StaticEncoderGraphs, slot: EncoderSlot, call: EncoderCall) -> tuple[np.ndarray, np.ndarray]:
    """One call on the graph thread: inputs in, replay, committed rows into the slot, mu and spks out."""
    io = graphs.io[call.window]
    n = call.tokens.shape[0]
    token = np.zeros((1, io.window), np.int64)
    token[0, :n] = call.tokens
    io.inputs["token"].update_inplace(token)
    io.inputs["token_len"].update_inplace(np.array([n], np.int64))
    io.inputs["lookahead_len"].update_inplace(np.array([call.lookahead], np.int64))
    io.inputs["cached_len"].update_inplace(np.array([call.cached], np.int64))
    io.inputs["commit_tokens"].update_inplace(np.array([call.commit], np.int64))
    io.inputs["embedding"].update_inplace(np.ascontiguousarray(call.embedding[None], np.float32))
    io.session.run_bound(slot.bindings[call.window], slot.run_options[call.window])
    spec = graphs.spec
    if call.commit:
        r = spec.token_mel_ratio
        enc_row = int(np.prod(spec.enc_row)) * 4
        up_row = int(np.prod(spec.up_row)) * 4
        copy = graphs.copier.copy
        copy(int(slot.enc.data_ptr()) + call.cached * enc_row, int(io.outputs["enc_window"].data_ptr()),
             call.commit * enc_row)
        copy(int(slot.up.data_ptr()) + r * call.cached * up_row, int(io.outputs["up_window"].data_ptr()),
             r * call.commit * up_row)
        copy(int(slot.pre.data_ptr()), int(io.outputs["pre_cache_new"].data_ptr()), int(np.prod(spec.pre_shape)) * 4)
        copy(int(slot.upconv.data_ptr()), int(io.outputs["upconv_cache_new"].data_ptr()),
             int(np.prod(spec.upconv_shape)) * 4)
    frames = spec.token_mel_ratio * (n - call.lookahead)
    mu = np.array(io.outputs["mu"].numpy()[:, :, :frames])
    spks = io.outputs["spks"].numpy()
    graphs.replays += 1
    return mu, spks


def load_static_encoder(bundle: Bundle, backend_name: str, load: Callable[[str], Session], setting: bool | None,
                        slots: int, spec: EncoderCacheSpec,
                        graph_thread: Callable[[], GraphThread]) -> StaticEncoderGraphs | None:
    """The engine's fixed-shape encoder graphs with `slots` requests' worth of device
    caches, made and captured now on the engine's graph thread, or None (the dynamic
    graph only). `setting` as graph_flow's (the estimator's graphs and these go together)."""
    found = fixed_shape_sessions(bundle, backend_name, load, setting, STATIC_ENCODER_PREFIX,
                                 "graph_flow needs a bundle exported with "
                                 "'cosyedge build export --static-flow-windows W,...' (this version's: it adds "
                                 "the encoder's graphs)")
    if found is None:
        return None
    sessions, device = found
    sizes = {int(s.input_shapes["enc_cache"][0]) for s in sessions}
    chunks = {int(e.raw.get("chunk_tokens", -1)) for n, e in bundle.stages.items()
              if n.startswith(STATIC_ENCODER_PREFIX)}
    if len(sizes) > 1 or chunks != {spec.chunk_tokens}:
        raise BundleError(f"{bundle.root}: fixed-shape encoder graphs with cache sizes {sorted(sizes)} and chunks "
                          f"{sorted(chunks)} (the bundle streams {spec.chunk_tokens}-token chunks); re-export")
    graphs = StaticEncoderGraphs(sessions, device, DeviceCopier(*device), spec, slots, graph_thread())
    graphs.warm_up()
    log.info("flow encoder: fixed-shape windows %s tokens over %d cached tokens, %d request slots%s%s",
             graphs.windows, graphs.cache_tokens, slots, ", CUDA graphs" if graphs.capture else "",
             f" (disabled: {graphs.disabled})" if graphs.disabled else "")
    return graphs
