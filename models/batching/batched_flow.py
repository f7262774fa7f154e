"""One estimator window for several streams in one call, over the batched fixed-shape graphs of
edge_build/export/flow_batch.py (`flow_estimator_batch_b<B>_w<W>`), on onnxruntime (CUDA graphs on ort-cuda, plainly
on the CPU, where it is tested).

A slot is one stream's estimator cache of one Euler step (as a StaticSlot of ort_static_flow.py): rows 2s and 2s + 1
(its guidance pair) of one K/V buffer `[L, 2, R, H, F, D]` and of one conv-history buffer `[R, K, Cmax, 2]`, with
its committed length and first visible frame kept here. The slots come in groups of `lanes` (the engine: one group
per Euler step, flow_batcher.py); a call of batch size B > 1 serves slots of one group at its lanes 0..B-1, and a
call of one slot runs the B = 1 graph bound at that slot: every block's `key_cache_<i>` and `key_cache_out_<i>` (and
the values) are bound to the SAME view `[i, 0|1, rows]`, so the graph writes the window's K/V in place; lanes of the
batch that have no window this time are idle (zero inputs, commit 0: their cache and history are untouched, their
K/V land past their length, where frames are free). The bindings of every (B, W, base slot) are made once (fixed
addresses, so ort-cuda captures each once, its own `gpu_graph_id`). After the call the conv history of the call's
rows is copied back from conv_cache_new by one device copy.

The buffers start zeroed and are only written with K/V of finite inputs, so a masked frame is never NaN (an additive
mask does not hide a NaN). Like every onnxruntime CUDA-graph replay, run() belongs on the engine's one graph thread
(models/backends/graph_thread.py); the scheduler that forms the batches (which slots, which window) is the caller."""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import onnxruntime as ort
from cosyedge_models.backends.fixed_shapes import CFG_ROWS, bucket, lane_step_bytes, pad_window
from cosyedge_models.backends.flow_cache import PrefixRows, read_only, same_values
from cosyedge_models.backends.graph_thread import CAPTURE_RUNS
from cosyedge_models.backends.ort import OrtSession
from cosyedge_models.backends.ort_cache import DeviceCopier, FixedBuffer, helper_session, lane_layout_model
from cosyedge_models.bundle.loader import BATCH_FLOW_NAME, Bundle
from cosyedge_models.errors import BundleError, SynthesisError

log = logging.getLogger(__name__)

SessionT = TypeVar("SessionT")

FLOAT_BYTES = 4  # the inputs, outputs and conv history (fp32 in every variant)
# the K/V lanes' element type, as the graphs declare their key_cache inputs (fp16 variant: half the bytes)
KV_DTYPES: dict[str, type[np.floating[Any]]] = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
_WINDOW_INPUTS = ("x", "mask", "mu", "cond")  # [2, C|1, T] per stream, padded to the window
_ROW_INPUTS = ("t", "spks")  # [2] and [2, C] per stream
_STREAM_INPUTS = ("cache_first", "cache_len", "commit")  # one int64 per stream


def kv_dtype(session: OrtSession) -> type[np.floating[Any]]:
    """The element type of the batched graph's K/V buffers."""
    declared = session.input_types["key_cache_0"]
    if declared not in KV_DTYPES:
        raise BundleError(f"batched estimator graph: K/V cache of {declared}; expected one of {sorted(KV_DTYPES)}")
    return KV_DTYPES[declared]


@dataclass(frozen=True)
class SlotCall:
    """One stream's window in a batched call: `feeds` x, mask, mu, cond [2, C|1, T], t [2], spks [2, C] (the
    guidance pair); its first `commit` frames are committed; `first`: the first cached frame it attends to."""

    slot: int
    feeds: Mapping[str, np.ndarray]
    commit: int
    first: int = 0


class _IO:
    """The inputs and outputs of one (batch size, window) graph, shared by its bindings at every base slot."""

    def __init__(self, graphs: BatchFlowGraphs, session: OrtSession, batch: int, window: int) -> None:
        kind, dev = graphs.device
        self.session, self.batch, self.window = session, batch, window
        shapes = {name: [int(d) for d in session.input_shapes[name]] for name in session.input_shapes}
        self.values = {name: ort.OrtValue.ortvalue_from_numpy(np.zeros(
            shapes[name], np.int64 if name in _STREAM_INPUTS else np.float32), kind, dev)
            for name in (*_WINDOW_INPUTS, *_ROW_INPUTS, *_STREAM_INPUTS)}
        self.values["dphi_dt"] = ort.OrtValue.ortvalue_from_shape_and_type(
            [int(d) for d in session.output_shapes["dphi_dt"]], np.float32, kind, dev)
        self.values["conv_cache_new"] = ort.OrtValue.ortvalue_from_shape_and_type(
            [CFG_ROWS * batch, *graphs.conv_row], np.float32, kind, dev)


class _Pair:
    """One (batch size, window) graph bound at the rows of slots base..base+B-1."""

    def __init__(self, graphs: BatchFlowGraphs, io: _IO, base: int, graph_id: int) -> None:
        kind, dev = graphs.device
        self.io, self.session, self.batch, self.window, self.base = io, io.session, io.batch, io.window, base
        self.values = io.values
        rows = CFG_ROWS * io.batch
        self.binding = io.session.io_binding()
        for name, value in io.values.items():
            if name in ("dphi_dt", "conv_cache_new"):
                self.binding.bind_ortvalue_output(name, value)
            else:
                self.binding.bind_ortvalue_input(name, value)
        self.binding.bind_input("conv_cache", kind, dev, np.float32, [rows, *graphs.conv_row],
                                graphs.conv_ptr(CFG_ROWS * base))
        kv_shape = [rows, *graphs.kv_declared]
        for i in range(graphs.blocks):
            for k, name in enumerate(("key", "value")):
                ptr = graphs.kv_ptr(i, k, CFG_ROWS * base)  # rows of slots base..base+B-1: contiguous
                self.binding.bind_input(f"{name}_cache_{i}", kind, dev, graphs.kv_dtype, kv_shape, ptr)
                self.binding.bind_output(f"{name}_cache_out_{i}", kind, dev, graphs.kv_dtype, kv_shape, ptr)
        self.options = ort.RunOptions()
        if io.session.cuda_graph:
            self.options.add_run_config_entry("gpu_graph_id", str(graph_id))

    def run(self) -> None:
        self.session.run_bound(self.binding, self.options)


class BatchFlowGraphs:
    """The batched estimator graphs of one engine over `groups` groups of `lanes` stream slots (0: the largest
    batch size); slot g * lanes + l is lane l of group g. A batched call serves slots of one group (the engine:
    one group per Euler step), at rows of its lanes 0..B-1; a call of one slot runs the B = 1 graph bound at
    that slot, so a stream alone never pays for padding rows. `warm_up()` (on the graph thread) before serving
    captures every binding."""

    def __init__(self, sessions: Mapping[tuple[int, int], OrtSession], device: tuple[str, int],
                 copier: DeviceCopier, lanes: int = 0, groups: int = 1) -> None:
        if not sessions:
            raise ValueError("no batched estimator graphs")
        self.device = device
        self.copier = copier
        self.batch_sizes = sorted({b for b, _ in sessions})
        self.windows = sorted({w for _, w in sessions})
        missing = [(b, w) for b in self.batch_sizes for w in self.windows if (b, w) not in sessions]
        if missing:
            raise BundleError(f"batched estimator graphs missing for (batch, window) {missing}")
        if self.batch_sizes[0] != 1:
            raise BundleError(f"batched estimator graphs need batch size 1 (a stream alone), got {self.batch_sizes}")
        self.lanes = lanes or self.batch_sizes[-1]
        # lanes is an exported batch size: a call of 2..lanes streams pads to a size that stays in its group
        if self.lanes not in self.batch_sizes or groups < 1:
            raise ValueError(f"lanes ({self.lanes}) must be one of the batch sizes {self.batch_sizes} "
                             f"and groups ({groups}) >= 1")
        self.groups = groups
        self.slots = self.lanes * groups
        first = sessions[(self.batch_sizes[0], self.windows[0])]
        self.blocks = sum(1 for n in first.input_names if n.startswith("key_cache_"))
        # [N, H, F, D], or [N, H, F, D / P, P] (the fused graphs: the same memory, written P values a thread)
        declared = [int(d) for d in first.input_shapes["key_cache_0"]]
        heads, self.buffer_frames = declared[1], declared[2]
        self.kv_row = (heads, self.buffer_frames, int(np.prod(declared[3:])))
        self.kv_declared = tuple(declared[1:])  # a row as the graphs bind it
        self.conv_row = tuple(int(d) for d in first.input_shapes["conv_cache"][1:])
        self.kv_dtype = kv_dtype(first)
        if any(kv_dtype(s) is not self.kv_dtype for s in sessions.values()):
            raise BundleError("batched estimator graphs of different K/V precisions in one bundle")
        self.kv_itemsize = np.dtype(self.kv_dtype).itemsize
        # a row holds at most cache_frames committed frames: the largest window always fits past them
        self.cache_frames = self.buffer_frames - self.windows[-1]
        rows = CFG_ROWS * self.slots
        kind, dev = device
        # by pointer, exactly its bytes (FixedBuffer): the largest buffer of an engine (42 GB for 16 lanes
        # at full size), which onnxruntime's allocator would round up to a power of two
        self._kv = FixedBuffer((self.blocks, 2, rows, *self.kv_row), self.kv_dtype, device)
        self._conv = ort.OrtValue.ortvalue_from_numpy(np.zeros((rows, *self.conv_row), np.float32), kind, dev)
        self._zero_conv = ort.OrtValue.ortvalue_from_numpy(np.zeros((CFG_ROWS, *self.conv_row), np.float32), kind, dev)
        # a slot's conv history from the host (seed, write_slot; on the graph thread): written in place, not a
        # device allocation per seed
        self._conv_stage = ort.OrtValue.ortvalue_from_numpy(np.zeros((CFG_ROWS, *self.conv_row), np.float32), kind, dev)
        self._staging: ort.OrtValue | None = None  # one slot's K/V [L, 2, 2, H, F, D] (read_slot, write_slot)
        self._layout: ort.InferenceSession | None = None  # seed(): a prefix into the lane layout
        self.lengths = [0] * self.slots
        # the saved prefix each slot still holds at frames [0, n) (seed()), kept across streams:
        # seeding 10 Euler steps' lanes from the host costs seconds at full size (H200, 2026-12-04)
        self._seeded: list[tuple[weakref.ref[object], int] | None] = [None] * self.slots
        self.seeds = 0  # prefixes written into a slot
        self.reuses = 0  # prefixes found still in their slot
        # the conv history a seed (or a reset: the zeros) last wrote into each slot while no call has run on it
        # since (as given, and its values): a seed of the same history writes nothing then (a lane refreshed
        # at its stream's end); the buffers start zeroed
        zeros = read_only(np.zeros((CFG_ROWS, *self.conv_row), np.float32))
        self._zeroed = (zeros, zeros)
        self._fresh: list[tuple[np.ndarray, np.ndarray] | None] = [self._zeroed] * self.slots
        self.fresh = 0  # reuses that found the slot so (nothing written)
        ios = {key: _IO(self, sessions[key], *key) for key in sorted(sessions)}
        bases = {b: ([s for g in range(groups) for s in range(g * self.lanes, (g + 1) * self.lanes)] if b == 1
                     else [g * self.lanes for g in range(groups)] if b <= self.lanes else [])
                 for b in self.batch_sizes}
        keys = [(b, w, base) for (b, w) in sorted(sessions) for base in bases[b]]
        self._pairs = {key: _Pair(self, ios[key[:2]], key[2], 1 + n) for n, key in enumerate(keys)}
        self.replays = 0

    @property
    def slot_bytes(self) -> int:
        """Device memory of one slot: its K/V rows and conv history."""
        return lane_step_bytes(self.blocks, int(np.prod(self.kv_row)), int(np.prod(self.conv_row)), self.kv_itemsize)

    def kv_ptr(self, block: int, kind: int, row: int) -> int:
        row_bytes = int(np.prod(self.kv_row)) * self.kv_itemsize
        return self._kv.ptr + ((block * 2 + kind) * CFG_ROWS * self.slots + row) * row_bytes

    def conv_ptr(self, row: int) -> int:
        return int(self._conv.data_ptr()) + row * int(np.prod(self.conv_row)) * FLOAT_BYTES

    def warm_up(self) -> None:
        """Every binding with every slot idle (zero inputs, commit 0, lengths 0), CAPTURE_RUNS times where captured."""
        for pair in self._pairs.values():
            for _ in range(CAPTURE_RUNS if pair.session.cuda_graph else 1):
                pair.run()
            self._restore_conv(pair)

    def close(self) -> None:
        """Free the lanes' K/V (the engine closes the sessions); the graphs serve nothing after it."""
        self._kv.close()

    def reset(self, slot: int) -> None:
        self.reset_many([slot])

    def reset_many(self, slots: Sequence[int]) -> None:
        """Slots for new streams: nothing committed, zero conv histories in few copy runs (stale K/V masked)."""
        row = CFG_ROWS * int(np.prod(self.conv_row)) * FLOAT_BYTES
        for slot in slots:
            self._check_slot(slot)
            self.lengths[slot] = 0
            self._fresh[slot] = None
        self.copier.copy_many([(self.conv_ptr(CFG_ROWS * s), int(self._zero_conv.data_ptr()), row) for s in slots])
        for slot in slots:  # once written (a failed copy leaves them unknown)
            self._fresh[slot] = self._zeroed

    def zeroed(self, slot: int) -> bool:  # as a reset left it: a new stream without a voice needs nothing
        return self._fresh[slot] is self._zeroed

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} outside 0..{self.slots - 1}")

    def fits(self, slot: int, frames: int, commit: int) -> bool:
        """Whether a window of `frames` committing `commit` fits the fixed shapes (else the dynamic graph)."""
        return bucket(self.windows, frames) is not None and self.lengths[slot] + commit <= self.cache_frames

    def pair_for(self, slots: Sequence[int], frames: int) -> tuple[int, int, int]:
        """(batch size, window, base slot) of the call serving `slots` (one group), windows of <= `frames` frames."""
        groups = {s // self.lanes for s in slots}
        if len(groups) != 1:
            raise ValueError(f"a batched call serves slots of one group of {self.lanes}, got {sorted(slots)}")
        w = bucket(self.windows, frames)
        if w is None:
            raise SynthesisError(f"a window of {frames} frames exceeds the batched windows {self.windows}")
        if len(slots) == 1:
            return 1, self.windows[w], slots[0]
        base = groups.pop() * self.lanes
        b = bucket(self.batch_sizes, max(slots) - base + 1)
        assert b is not None  # lanes <= the largest batch size
        return self.batch_sizes[b], self.windows[w], base

    def run(self, calls: Sequence[SlotCall]) -> list[np.ndarray]:
        """One batched call for these slots (of one group); each call's dphi_dt [2, C, T], in order."""
        slots = [c.slot for c in calls]
        if not calls or len(set(slots)) != len(slots):
            raise ValueError(f"a batched call needs distinct slots, got {slots}")
        for c in calls:
            self._check_slot(c.slot)
            frames = int(c.feeds["x"].shape[2])
            if not 0 <= c.commit <= frames or not 0 <= c.first <= self.lengths[c.slot]:
                raise ValueError(f"slot {c.slot}: commit {c.commit} of {frames} frames, first {c.first} of "
                                 f"{self.lengths[c.slot]} committed")
            if not self.fits(c.slot, frames, c.commit):
                raise SynthesisError(f"slot {c.slot}: a window of {frames} frames committing {c.commit} after "
                                     f"{self.lengths[c.slot]} does not fit windows {self.windows} over "
                                     f"{self.cache_frames} frames")
        b, w, base = self.pair_for(slots, max(int(c.feeds["x"].shape[2]) for c in calls))
        pair = self._pairs[(b, w, base)]
        host = {name: np.zeros(pair.values[name].shape(), np.float32) for name in (*_WINDOW_INPUTS, *_ROW_INPUTS)}
        first = np.zeros(b, np.int64)
        commit = np.zeros(b, np.int64)
        for c in calls:
            lane = c.slot - base
            rows = slice(CFG_ROWS * lane, CFG_ROWS * lane + CFG_ROWS)
            for name in _WINDOW_INPUTS:
                host[name][rows] = pad_window(c.feeds[name], w)
            for name in _ROW_INPUTS:
                host[name][rows] = c.feeds[name]
            first[lane], commit[lane] = c.first, c.commit
        for c in calls:
            if self.lengths[c.slot] < self._floor(c.slot):  # its window lands inside the kept prefix
                self._seeded[c.slot] = None
        called = {c.slot for c in calls}
        for slot in called:
            self._fresh[slot] = None
        # an idle lane's window lands at its length, or past the prefix it keeps
        lengths = [self.lengths[s] if s in called else max(self.lengths[s], self._floor(s))
                   for s in range(base, base + b)]
        for name, value in host.items():
            pair.values[name].update_inplace(value)
        pair.values["cache_first"].update_inplace(first)
        pair.values["cache_len"].update_inplace(np.array(lengths, np.int64))
        pair.values["commit"].update_inplace(commit)
        pair.run()
        self._restore_conv(pair)
        self.replays += 1
        for c in calls:
            self.lengths[c.slot] += c.commit
        dphi = pair.values["dphi_dt"].numpy()
        return [np.array(dphi[CFG_ROWS * (c.slot - base): CFG_ROWS * (c.slot - base) + CFG_ROWS, :,
                              : c.feeds["x"].shape[2]]) for c in calls]

    def _restore_conv(self, pair: _Pair) -> None:
        """conv_cache_new of the call's rows over the history (unchanged where nothing was committed)."""
        new = pair.values["conv_cache_new"]
        self.copier.copy(self.conv_ptr(CFG_ROWS * pair.base), int(new.data_ptr()),
                         int(np.prod(new.shape())) * FLOAT_BYTES)

    def _block_bytes(self) -> int:
        return CFG_ROWS * int(np.prod(self.kv_row)) * self.kv_itemsize  # one slot's rows of one block's K or V

    def _stage(self) -> ort.OrtValue:
        if self._staging is None:
            self._staging = ort.OrtValue.ortvalue_from_shape_and_type(
                [self.blocks, 2, CFG_ROWS, *self.kv_row], self.kv_dtype, *self.device)
        return self._staging

    def read_slot(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of a slot's committed K/V [L, 2, 2, H, len, D] and conv history [2, K, Cmax, 2]
        (2 L device copies in one run: moving a stream to the dynamic graph, trimming, tests)."""
        self._check_slot(slot)
        stage, nbytes = self._stage(), self._block_bytes()
        self.copier.copy_many([(int(stage.data_ptr()) + (i * 2 + k) * nbytes, self.kv_ptr(i, k, CFG_ROWS * slot),
                                nbytes) for i in range(self.blocks) for k in range(2)])
        kv = np.array(stage.numpy()[:, :, :, :, : self.lengths[slot]], np.float32)  # fp32, as the other caches
        rows = slice(CFG_ROWS * slot, CFG_ROWS * slot + CFG_ROWS)
        return kv, np.array(self._conv.numpy()[rows])

    def _floor(self, slot: int) -> int:
        """Frames at the front of the slot that hold a kept prefix (0: none)."""
        seeded = self._seeded[slot]
        return 0 if seeded is None or seeded[0]() is None else seeded[1]

    def seed(self, slot: int, prefix: PrefixRows, conv: np.ndarray) -> None:
        """A saved voice's prefix (`prefix`: its rows [n, L, 2, 2, H, D], the voice cache's) as the slot's committed
        frames, and its conv history [2, K, Cmax, 2]. Where the slot still holds that prefix from an earlier
        stream (streams only write past it, idle lanes too) only the conv history is written; else the prefix
        goes from the voice's copy on this device (uploaded once per voice and device, shared with the
        single-stream slots) through one Transpose/Pad run into the staging buffer, then 2 L device copies
        into the lane (one run)."""
        self._check_slot(slot)
        frames = prefix.frames
        if frames > self.cache_frames:
            raise ValueError(f"{frames} frames exceed the batched cache's {self.cache_frames}")
        if self._holds(slot, prefix):
            self._write_conv(slot, conv)
            self.lengths[slot] = frames
            self.reuses += 1
            return
        self._seeded[slot] = None
        kind, dev = self.device
        stage = self._stage()

        def upload(host: np.ndarray) -> ort.OrtValue:  # as the single-stream slots' copy_prefix
            return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(host, dtype=np.float32), kind, dev)

        with prefix.lease(self.device, upload) as src:
            if self._layout is None:
                self._layout = helper_session(lane_layout_model(list(_LANE_PERM), half=self.kv_dtype is np.float16),
                                              self.device)
            binding = self._layout.io_binding()
            binding.bind_ortvalue_input("src", src)
            pads = np.zeros(2 * len(_LANE_PERM), np.int64)
            pads[len(_LANE_PERM) + _LANE_PERM.index(0)] = self.buffer_frames - frames  # frames padded at the end
            binding.bind_cpu_input("pads", pads)
            binding.bind_output("dst", kind, dev, self.kv_dtype, [self.blocks, 2, CFG_ROWS, *self.kv_row],
                                int(stage.data_ptr()))
            self._layout.run_with_iobinding(binding)
        self._from_stage(slot, frames, conv)
        self._seeded[slot] = (weakref.ref(prefix), frames)
        self.seeds += 1

    def seed_many(self, items: Sequence[tuple[int, PrefixRows | None, np.ndarray | None]]) -> None:
        """seed() for several (slot, prefix, conv history) on one graph-thread turn: the lanes that still hold their
        prefix get their conv histories in one upload and few copy runs (each seed() of those took ~1.2 ms of the
        graph thread on the H200, twenty-first run), and those whose history no call has changed since a seed
        wrote it nothing (`fresh`: refreshed at their last stream's end, lanes.py); the others seed() one by
        one. An item without a prefix is a reset() (a new stream's lane), done first, all in one run."""
        self.reset_many([slot for slot, prefix, _ in items if prefix is None])
        kept = []
        for slot, prefix, conv in items:
            if prefix is None or conv is None:
                continue
            self._check_slot(slot)
            if not self._holds(slot, prefix):
                self.seed(slot, prefix, conv)
            elif self.seat_fresh(slot, prefix, conv):
                self.reuses += 1
                self.fresh += 1
            else:
                kept.append((slot, prefix.frames, conv))
        if len(kept) == 1:
            self._write_conv(kept[0][0], kept[0][2])
        elif kept:
            row = CFG_ROWS * int(np.prod(self.conv_row)) * FLOAT_BYTES
            kind, dev = self.device
            values = np.stack([self._rows(conv) for _, _, conv in kept])
            stage = ort.OrtValue.ortvalue_from_numpy(values, kind, dev)
            base = int(stage.data_ptr())
            # a run returns once its copies are done: `stage` may go after
            self.copier.copy_many([(self.conv_ptr(CFG_ROWS * slot), base + i * row, row)
                                   for i, (slot, _, _) in enumerate(kept)])
            for i, (slot, _, conv) in enumerate(kept):
                self._fresh[slot] = (conv, values[i])
        for slot, frames, _ in kept:
            self.lengths[slot] = frames
        self.reuses += len(kept)

    def seat_fresh(self, slot: int, prefix: PrefixRows, history: np.ndarray, look: bool = True) -> bool:
        """Whether the slot holds `prefix` and `history` ([2, K, Cmax, 2]) as a seed or refresh left them, no
        call having changed them since; then its length is the prefix's, and a seed would write nothing.
        Without `look` only a view of the same read-only history counts (flow_cache.same_values: a voice's)."""
        fresh = self._fresh[slot]
        if fresh is None or not self._holds(slot, prefix):
            return False
        if not same_values(fresh[0], history) and not (look and np.array_equal(fresh[1], self._rows(history))):
            return False
        self.lengths[slot] = prefix.frames
        return True

    def _rows(self, conv: np.ndarray) -> np.ndarray:
        """A conv history [2, K, Cmax, 2] as the slot's rows (a copy where `conv` is a transposed view)."""
        return np.asarray(conv, np.float32).reshape(CFG_ROWS, *self.conv_row)

    def _holds(self, slot: int, prefix: PrefixRows) -> bool:
        """Whether the slot still holds `prefix` from an earlier stream (streams only write past it)."""
        kept = self._seeded[slot]
        return kept is not None and kept[0]() is prefix and kept[1] == prefix.frames

    def _write_conv(self, slot: int, conv: np.ndarray) -> None:
        history = np.array(conv, np.float32).reshape(CFG_ROWS, *self.conv_row)
        self._conv_stage.update_inplace(history)
        self.copier.copy(self.conv_ptr(CFG_ROWS * slot), int(self._conv_stage.data_ptr()),
                         CFG_ROWS * int(np.prod(self.conv_row)) * FLOAT_BYTES)
        self._fresh[slot] = (conv, history)

    def write_slot(self, slot: int, kv: np.ndarray, conv: np.ndarray) -> None:
        """A slot's committed K/V [L, 2, 2, H, n, D] and conv history [2, K, Cmax, 2] from the host
        (a saved voice's prefix, a trim): one upload and 2 L + 1 device copies."""
        self._check_slot(slot)
        self._seeded[slot] = None
        frames = int(kv.shape[4])
        if frames > self.cache_frames:
            raise ValueError(f"{frames} frames exceed the batched cache's {self.cache_frames}")
        host = np.zeros((self.blocks, 2, CFG_ROWS, *self.kv_row), self.kv_dtype)
        host[:, :, :, :, :frames] = kv
        self._stage().update_inplace(host)
        self._from_stage(slot, frames, conv)

    def _from_stage(self, slot: int, frames: int, conv: np.ndarray) -> None:
        """The staging buffer's K/V into the slot's rows (2 L device copies in one run), its conv history,
        its length."""
        stage, nbytes = self._stage(), self._block_bytes()
        self.copier.copy_many([(self.kv_ptr(i, k, CFG_ROWS * slot), int(stage.data_ptr()) + (i * 2 + k) * nbytes,
                                nbytes) for i in range(self.blocks) for k in range(2)])
        self._write_conv(slot, conv)
        self.lengths[slot] = frames


# a prefix's rows [n, L, 2, 2, H, D] (frame-major, flow_cache.PrefixRows) -> a lane's [L, 2, 2, H, n, D]
_LANE_PERM = (1, 2, 3, 4, 0, 5)


def lane_bytes(sessions: Mapping[tuple[int, int], OrtSession], groups: int) -> int:
    """Device memory of one lane in every group (one stream's caches): its K/V rows of every block
    (in the graphs' K/V precision) and its conv history."""
    first = sessions[min(sessions)]
    blocks = sum(1 for n in first.input_names if n.startswith("key_cache_"))
    kv = int(np.prod([int(d) for d in first.input_shapes["key_cache_0"][1:]]))
    conv = int(np.prod([int(d) for d in first.input_shapes["conv_cache"][1:]]))
    return groups * lane_step_bytes(blocks, kv, conv, np.dtype(kv_dtype(first)).itemsize)


def batch_flow_sessions(bundle: Bundle, load: Callable[[str, Path], SessionT]) -> dict[tuple[int, int], SessionT]:
    """The bundle's batched estimator graphs (manifest stages `flow_estimator_batch_b<B>_w<W>`),
    keyed (B, W), each loaded with `load(stage, path)`; empty when the bundle has none."""
    found = batched_stages(bundle, BATCH_FLOW_NAME, load)
    if found:
        log.info("flow estimator: batched graphs for batch sizes %s, windows %s",
                 sorted({b for b, _ in found}), sorted({w for _, w in found}))
    return found


def batched_stages(bundle: Bundle, name: re.Pattern[str], load: Callable[[str, Path], SessionT]
                   ) -> dict[tuple[int, int], SessionT]:
    """The bundle's stages whose names `name` matches (groups: batch size and window), keyed by
    those two, each loaded with `load(stage, path)`; a missing file is refused."""
    found = {}
    for stage, entry in bundle.manifest.get("stages", {}).items():
        m = name.match(str(stage))
        if m:
            path = bundle.root / str(entry["file"])
            if not path.is_file():
                raise BundleError(f"{bundle.root}: stage file {entry['file']} is missing")
            found[(int(m.group(1)), int(m.group(2)))] = load(str(stage), path)
    return found
