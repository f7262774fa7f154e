"""Streaming flow estimator calls as CUDA graphs on onnxruntime's CUDA
provider, over the fixed-shape graphs of edge_build/export/flow_static.py.

The dynamic estimator is ~4,200 kernels and ~1,000 CPU shape nodes per Euler
step (20-25 ms a step on an H200 at any window length): onnxruntime cannot
capture it. The static graphs have one window size each (a bucket: shorter
windows are right-padded with mask 0) and a cache of a fixed number of frames
with a validity mask, so every call of one (cache buffer, window) pair has
the same shapes and addresses, and onnxruntime replays it as one graph launch.

A captured graph replays on the addresses it was captured with, so the cache
buffers are pooled: a `StaticSlot` is one Euler step's cache of one request
(the K/V buffer [S, *row] and the conv history) with one graph id per window
size, borrowed by a `StaticStepCache` for the request's life and given back
at close. onnxruntime keeps captured graphs per thread and captures in CUDA's
global mode, so every run of these sessions happens on the engine's one
GraphThread (models/backends/graph_thread.py): all slots are made and every
(slot, window) graph is captured there at load (`warm_up`), before any
request runs; a request's call is one piece of work there (inputs in, replay,
the window's committed K/V rows copied into the slot's buffer by one
device-to-device copy, models/backends/ort_cache.py's DeviceCopier, dphi out).
The per-window inputs and outputs are shared by all slots: the thread runs
one call at a time (they share the GPU anyway).

A request whose window exceeds the largest bucket, or whose cache outgrows
S, moves (once, by a device copy) to an ordinary BoundStepCache over the
dynamic graph; requests beyond the pool use it from the start. On the CPU the
same code runs the same graphs without capture (that is how it is tested)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
import onnxruntime as ort
from cosyedge_models.backends.base import Session
from cosyedge_models.backends.fixed_shapes import (
    AUTO_DEVICE_FRACTION,
    SlotBorrower,
    SlotPool,
    bucket,
    commit_index,
    device_total_bytes,
    flow_slot_bytes,
    pad_window,
    prefix_fits,
    slots_that_fit,
    trim_copy,
    valid_mask,
    visible_first,
)
from cosyedge_models.backends.flow_cache import PrefixRows, StepCache, StepCacheSpec
from cosyedge_models.backends.graph_thread import CAPTURE_RUNS, GraphThread
from cosyedge_models.backends.ort import OrtSession, fixed_shape_sessions
from cosyedge_models.backends.ort_cache import BoundStepCache, DeviceCopier, FixedBuffer, copy_prefix
from cosyedge_models.bundle.loader import STATIC_FLOW_PREFIX, Bundle
from cosyedge_models.errors import BundleError, SynthesisError

log = logging.getLogger(__name__)

_INPUTS = ("x", "mask", "mu", "t", "spks", "cond", "cache_valid", "commit_index")


class _WindowIO:
    """The inputs and outputs of one window size's graph, bound by every slot."""

    def __init__(self, session: OrtSession, device: tuple[str, int]) -> None:
        kind, dev = device
        self.session = session
        self.window = int(session.input_shapes["x"][2])
        self.inputs = {
            name: ort.OrtValue.ortvalue_from_shape_and_type(
                [int(d) for d in session.input_shapes[name]], np.int64 if name == "commit_index" else np.float32,
                kind, dev)
            for name in _INPUTS
        }
        self.outputs = {
            name: ort.OrtValue.ortvalue_from_shape_and_type([int(d) for d in session.output_shapes[name]],
                                                            np.float32, kind, dev)
            for name in ("dphi_dt", "att_window", "conv_cache_new")
        }


class StaticSlot:
    """One Euler step's cache buffers and its graph ids, one per window size."""

    def __init__(self, index: int, graphs: StaticFlowGraphs) -> None:
        kind, dev = graphs.device
        self.index = index
        self.frames = graphs.cache_frames
        # zeroed: free rows are masked, and a weight of 0 times a NaN left in memory would be NaN
        self.kv = FixedBuffer((self.frames, *graphs.row), np.float32, graphs.device)  # exactly its bytes
        self.conv = ort.OrtValue.ortvalue_from_numpy(np.zeros(graphs.conv, np.float32), kind, dev)
        self.bindings: list[ort.IOBinding] = []
        self.run_options: list[ort.RunOptions] = []
        for w, io in enumerate(graphs.io):
            binding = io.session.io_binding()
            for name, value in io.inputs.items():
                binding.bind_ortvalue_input(name, value)
            binding.bind_input("att_cache", kind, dev, np.float32, list(self.kv.shape), self.kv.ptr)
            binding.bind_ortvalue_input("conv_cache", self.conv)
            for name, value in io.outputs.items():
                binding.bind_ortvalue_output(name, value)
            self.bindings.append(binding)
            options = ort.RunOptions()
            if graphs.capture:  # one captured graph per slot and window size
                options.add_run_config_entry("gpu_graph_id", str(1 + index * len(graphs.io) + w))
            self.run_options.append(options)

    def ptr(self, frame: int, row_bytes: int) -> int:
        return self.kv.ptr + frame * row_bytes


class BoundSlot(Protocol):
    """A slot's bindings and run options, one per window size."""

    bindings: list[ort.IOBinding]
    run_options: list[ort.RunOptions]


BoundSlotT = TypeVar("BoundSlotT", bound=BoundSlot)


def capture_slots(pool: SlotPool[BoundSlotT], sessions: Sequence[OrtSession], runs: int, what: str) -> None:
    """Every slot's graph of every window (`sessions`, in window order) run `runs` times
    (onnxruntime captures on the last); a refusal disables the pool, logged."""
    try:
        for slot in pool.all_slots():
            for w, session in enumerate(sessions):
                for _ in range(runs):
                    session.run_bound(slot.bindings[w], slot.run_options[w])
    except SynthesisError as exc:
        pool.disabled = str(exc)[:500]
        log.warning("%s disabled at load, the dynamic path takes over: %s", what, exc)


class StaticFlowGraphs(SlotPool[StaticSlot]):
    """The fixed-shape estimator sessions of one engine and their slot pool,
    run on `thread`. `__call__` is a Backend.flow_cache: a StaticStepCache
    while slots last, else the ordinary device cache over the dynamic graph.
    `warm_up()` (load_static_flow calls it) makes every slot and captures
    every graph before the engine serves."""

    def __init__(self, sessions: Sequence[OrtSession], device: tuple[str, int], copier: DeviceCopier,
                 max_slots: int, thread: GraphThread) -> None:
        if not sessions:
            raise ValueError("no fixed-shape estimator graphs")
        super().__init__(max_slots, thread)
        self.device = device
        self.copier = copier
        self.io = sorted((_WindowIO(s, device) for s in sessions), key=lambda io: io.window)
        self.windows = [io.window for io in self.io]
        att = tuple(int(d) for d in sessions[0].input_shapes["att_cache"])
        self.cache_frames, self.row = att[0], att[1:]
        self.conv = tuple(int(d) for d in sessions[0].input_shapes["conv_cache"])
        self.capture = all(s.cuda_graph for s in sessions)

    def bucket(self, frames: int) -> int | None:
        """Index of the smallest window that holds `frames`, or None."""
        return bucket(self.windows, frames)

    def warm_up(self) -> None:
        """On the graph thread, before any request: every slot, and each of its
        (window) graphs run CAPTURE_RUNS times (onnxruntime captures on the
        last; once without capture on the CPU). A refusal disables the graphs."""
        self.thread.call(self._warm_up)

    def _warm_up(self) -> None:
        runs = CAPTURE_RUNS if self.capture else 1
        for io in self.io:  # defined inputs: zero masks, no valid cache rows
            for value in io.inputs.values():
                value.update_inplace(np.zeros(value.shape(), np.int64 if value.data_type() == "tensor(int64)"
                                              else np.float32))
        while self.slot_count < self.max_slots:
            self.register(StaticSlot(self.slot_count, self))
        capture_slots(self, [io.session for io in self.io], runs, "fixed-shape flow graphs")

    def acquire(self, spec: StepCacheSpec) -> StaticSlot | None:
        if spec.dtype != np.float32 or spec.row != self.row or spec.conv != self.conv:
            return None  # the fixed-shape graphs are exported in fp32, for this model's shapes
        slot = self.take_slot()
        if slot is None and self.slot_count < self.max_slots:  # only before warm_up (tests)
            self.register(StaticSlot(self.slot_count, self))
            slot = self.take_slot()
        return slot

    def __call__(self, session: Session, spec: StepCacheSpec) -> StepCache:
        if not isinstance(session, OrtSession):
            raise SynthesisError(f"fixed-shape flow graphs need an onnxruntime estimator session, got {session!r}")
        slot = self.acquire(spec) if self.disabled is None else None
        if slot is None:
            return BoundStepCache(session, spec, self.copier)
        return StaticStepCache(self, slot, session, spec)

    def close(self) -> None:
        """Drop the slots and free their caches (the engine closes the sessions and the graph thread)."""
        for slot in self.drop_slots():
            slot.kv.close()


@dataclass(frozen=True)
class _Call:
    """One estimator call's host inputs, as the graph thread writes them."""

    window: int  # index into StaticFlowGraphs.io
    feeds: Mapping[str, np.ndarray]
    valid: np.ndarray
    commit: int
    at: int  # the slot frame the committed rows go to


class StaticStepCache(SlotBorrower[StaticSlot, BoundStepCache]):
    """StepCache on a StaticSlot; moves to a BoundStepCache over the dynamic
    graph when a call does not fit the fixed shapes."""

    def __init__(self, graphs: StaticFlowGraphs, slot: StaticSlot, dynamic: OrtSession, spec: StepCacheSpec) -> None:
        super().__init__(slot)
        self.spec = spec
        self._graphs = graphs
        self._dynamic = dynamic

    def _first(self) -> int:
        return visible_first(self._length, self.spec.visible)

    def _move(self) -> BoundStepCache:
        """To the dynamic graph: the visible rows and the conv history by device copy."""
        slot = self._slot
        assert slot is not None
        moved = BoundStepCache(self._dynamic, self.spec, self._graphs.copier)
        first = self._first()
        moved.adopt(slot.ptr(first, self.spec.row_bytes), self._length - first, slot.conv)
        self._give_back()
        self._moved = moved
        self._graphs.note_move()
        log.debug("flow cache: %d frames moved to the dynamic estimator", self._length - first)
        return moved

    def preload(self, rows: PrefixRows, conv: np.ndarray) -> None:
        """A saved voice's prefix, seeded into the slot (rows by device copy from the voice's
        copy on this device, the conv history in place: the captured graphs read both at
        their addresses), so the stream stays on the fixed shapes. A prefix that leaves no
        room for a window, or a cache of another dtype, goes to the dynamic graph."""
        if self._length or self._moved is not None:
            raise RuntimeError("preload() on a cache that holds frames")
        slot = self._slot
        graphs = self._graphs
        if (slot is None or not prefix_fits(rows.frames, graphs.windows, graphs.cache_frames)
                or np.dtype(self.spec.dtype) != np.float32):
            self._move().preload(rows, conv)
            return
        copy_prefix(graphs.copier, slot.ptr(0, self.spec.row_bytes), rows, np.float32)
        slot.conv.update_inplace(np.ascontiguousarray(conv, dtype=np.float32))
        self._length = rows.frames

    def run(self, feeds: Mapping[str, np.ndarray], commit: int) -> np.ndarray:
        if self._closed:
            raise RuntimeError("flow cache used after close()")
        frames = int(feeds["x"].shape[2])
        w = self._graphs.bucket(frames)
        if self._moved is None and (w is None or self._length + commit > self._graphs.cache_frames
                                    or self._graphs.disabled is not None):
            self._move()
        if self._moved is not None:
            return self._moved.run(feeds, commit)
        slot = self._slot
        assert slot is not None and w is not None
        graphs = self._graphs
        call = _Call(w, feeds, valid_mask(graphs.cache_frames, self._first(), self._length), commit, self._length)
        out = graphs.replay(functools.partial(_replay, graphs, slot, self.spec, call), "fixed-shape flow graphs")
        if out is None:
            return self._move().run(feeds, commit)  # nothing was committed: the same call there
        self._length += commit
        return out

    def trim(self) -> None:
        if self._moved is not None:
            self._moved.trim()
            return
        slot = self._slot
        move = trim_copy(self._length, self.spec.visible, self._graphs.cache_frames) if slot is not None else None
        if slot is not None and move is not None:
            row = self.spec.row_bytes
            self._graphs.copier.copy(slot.ptr(move.dst, row), slot.ptr(move.src, row), move.nbytes(row))
            self._length = move.frames

    def nbytes(self) -> int:
        if self._moved is not None:
            return self._moved.nbytes()
        return 0 if self._slot is None else self._graphs.cache_frames * self.spec.row_bytes + self.spec.conv_bytes

    def _give_back(self) -> None:
        """The slot back to the pool with a zero conv history for its next borrower (its K/V
        rows are masked by cache_valid), whether this cache closes or moves."""
        if self._slot is not None:
            kind, dev = self._graphs.device
            zero = ort.OrtValue.ortvalue_from_numpy(np.zeros(self.spec.conv, np.float32), kind, dev)
            self._graphs.copier.copy(int(self._slot.conv.data_ptr()), int(zero.data_ptr()), self.spec.conv_bytes)
            self._graphs.release(self._slot)
            self._slot = None

    def close(self) -> None:
        self._give_back()
        if self._moved is not None:
            self._moved.close()
            self._moved = None
        self._length = 0
        self._closed = True


def _replay(graphs: StaticFlowGraphs, slot: StaticSlot, spec: StepCacheSpec, call: _Call) -> np.ndarray:
    """One call on the graph thread: inputs in, replay, committed rows into the slot, dphi out."""
    io = graphs.io[call.window]
    feeds = call.feeds
    frames = int(feeds["x"].shape[2])
    for name in ("x", "mask", "mu", "cond"):
        io.inputs[name].update_inplace(pad_window(feeds[name], io.window))
    io.inputs["t"].update_inplace(np.ascontiguousarray(feeds["t"], np.float32))
    io.inputs["spks"].update_inplace(np.ascontiguousarray(feeds["spks"], np.float32))
    io.inputs["cache_valid"].update_inplace(call.valid)
    io.inputs["commit_index"].update_inplace(commit_index(call.commit, int(io.inputs["commit_index"].shape()[0])))
    io.session.run_bound(slot.bindings[call.window], slot.run_options[call.window])
    if call.commit:
        row = spec.row_bytes
        graphs.copier.copy(slot.ptr(call.at, row), int(io.outputs["att_window"].data_ptr()), call.commit * row)
        graphs.copier.copy(int(slot.conv.data_ptr()), int(io.outputs["conv_cache_new"].data_ptr()), spec.conv_bytes)
    out = np.array(io.outputs["dphi_dt"].numpy()[:, :, :frames])
    graphs.replays += 1
    return out


def request_bytes(sessions: Sequence[OrtSession], n_timesteps: int) -> tuple[int, int]:
    """(per request, fixed) device memory of the slots (fixed_shapes.flow_slot_bytes): a request's K/V
    buffers and conv history (fp32, one per Euler step) with the graphs captured at them; a session a window."""
    return flow_slot_bytes([int(d) for d in sessions[0].input_shapes["att_cache"]],
                           [int(d) for d in sessions[0].input_shapes["conv_cache"]], n_timesteps, len(sessions))


def load_static_flow(bundle: Bundle, backend_name: str, load: Callable[[str], Session], setting: bool | None,
                     slots: int, graph_thread: Callable[[], GraphThread]) -> StaticFlowGraphs | None:
    """The engine's fixed-shape estimator graphs with `slots` requests' worth
    of caches (one per Euler step each), made and captured now on the
    engine's graph thread (`graph_thread()` gives it),
    or None (the dynamic graph only). setting True: on (on the CPU without
    capture: for tests); None (auto): on for ort-cuda when the bundle has the
    graphs, with as many of the `slots` as fit in AUTO_DEVICE_FRACTION of
    the GPU's memory (off when none does: an 8 GB Jetson at full size);
    False: off."""
    found = fixed_shape_sessions(bundle, backend_name, load, setting, STATIC_FLOW_PREFIX,
                                 "graph_flow needs a bundle exported with "
                                 "'cosyedge build export --static-flow-windows W,...'")
    if found is None:
        return None
    ort_sessions, device = found
    sizes = {int(s.input_shapes["att_cache"][0]) for s in ort_sessions}
    if len(sizes) > 1:
        raise BundleError(f"{bundle.root}: fixed-shape estimator graphs with different cache sizes "
                          f"{sorted(sizes)}; re-export")
    if setting is None and slots > 0:  # none asked for (the batched lanes hold every stream): the sessions only
        per_request, fixed = request_bytes(ort_sessions, bundle.flow.n_timesteps)
        total = device_total_bytes(device[1])
        slots = slots_that_fit(slots, per_request, total, fixed_bytes=fixed)
        if slots == 0:
            log.info("flow estimator: fixed-shape graphs off (auto): one request's caches and captures take %.1f GB "
                     "(and the graphs' sessions %.1f GB), more than %.0f%% of the GPU's %.1f GB; set graph_flow on "
                     "to force, or export a smaller --static-flow-cache", per_request / 1e9, fixed / 1e9,
                     AUTO_DEVICE_FRACTION * 100, total / 1e9)
            return None
    # onnxruntime creates a device's allocator on first use without a lock: before request threads race
    ort.OrtValue.ortvalue_from_shape_and_type([1], np.uint8, *device)
    graphs = StaticFlowGraphs(ort_sessions, device, DeviceCopier(*device), slots * bundle.flow.n_timesteps,
                              graph_thread())
    graphs.warm_up()
    log.info("flow estimator: fixed-shape windows %s over %d cached frames, %d request slots%s%s", graphs.windows,
             graphs.cache_frames, slots, ", CUDA graphs" if graphs.capture else "",
             f" (disabled: {graphs.disabled})" if graphs.disabled else "")
    return graphs
