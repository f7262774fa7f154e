"""Concurrent streams' flow encoder windows as one batched replay on the engine's GPU graph thread,
over the graphs of edge_build/export/flow_encoder_batch.py (exported with the batched estimator
windows), with `graph_encoder_batch` on (and the fixed-shape encoder graphs, `graph_flow`).

A stream's encoder caches live in a lane of the graphs' lane buffers for the stream's life (an
`EncoderLane`, borrowed as a single-stream slot is: PooledEncoderCache keeps the control flow, a
move to the host caches included). A call queues itself and submits a turn on the graph thread at
its caller's priority (a first chunk's stays first-audio work); a turn runs every call waiting then
(up to the largest batch size) as one replay of the next exported batch size at the largest of
their windows (shorter ones right-padded, exact), then copies each row's committed rows and conv
histories into its lane. A turn whose call an earlier turn served is a no-op. On the H200 (sixteenth
run) eight streams' first chunks ran their encoder calls one after another, ~8 ms each, on the thread
that also runs their estimator windows; here the calls that wait together share one.

A stream of a saved voice seeds its lane (the voice's prefix rows and conv histories, a queued turn);
at its end the lane gets the voice's conv histories again (its rows are intact), so the voice's next
stream there writes nothing and queues no turn; a stream without a voice zeroes such a lane first.

Streams beyond the lanes take `fallback` (the single-stream slots, or the host caches). On the CPU
the same code runs without capture (that is how it is tested)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import onnxruntime as ort
from cosyedge_models.backends.base import Session
from cosyedge_models.backends.encoder_cache import (
    EncoderCache,
    EncoderCacheFactory,
    EncoderCacheSpec,
    EncoderCall,
    EncoderOut,
    EncoderPrefix,
    PooledEncoderCache,
)
from cosyedge_models.backends.fixed_shapes import SlotPool, prefix_fits
from cosyedge_models.backends.graph_thread import CAPTURE_RUNS, GraphThread
from cosyedge_models.backends.ort import OrtSession
from cosyedge_models.backends.ort_cache import DeviceCopier, copy_prefix, device_zeros
from cosyedge_models.batching.batched_flow import batched_stages
from cosyedge_models.batching.batched_step import padded_size
from cosyedge_models.batching.turns import QueuedOnce, TurnQueue
from cosyedge_models.bundle.loader import BATCH_ENCODER_NAME, BATCH_ENCODER_PREFIX, Bundle
from cosyedge_models.errors import BundleError

log = logging.getLogger(__name__)

ResultT = TypeVar("ResultT")

_INT_INPUTS = ("token", "token_len", "lookahead_len", "lane", "cached_len", "commit_tokens")
_LANES = ("enc_lanes", "up_lanes", "pre_lanes", "upconv_lanes")
_OUTPUTS = ("mu", "spks", "enc_window", "up_window", "pre_cache_new", "upconv_cache_new")
GRAPH_ID_BASE = 200_000  # apart from the other stages' ids (the single-stream encoder's start at 100,000)


def _shape(session: OrtSession, name: str, outputs: bool = False) -> tuple[int, ...]:
    return tuple(int(d) for d in (session.output_shapes if outputs else session.input_shapes)[name])


@dataclass(frozen=True)
class EncoderLane:
    """A stream's place in the lane buffers."""

    index: int
    lane_bytes: int

    def nbytes(self) -> int:
        return self.lane_bytes


class _BatchIO:
    """One (batch size, window) graph's inputs and outputs, bound once with the lane buffers."""

    def __init__(self, session: OrtSession, graphs: BatchEncoderGraphs, graph_id: int) -> None:
        self.session = session
        self.batch, self.window = _shape(session, "token")
        self.inputs = {n: device_zeros(_shape(session, n), np.int64 if n in _INT_INPUTS else np.float32, graphs.device)
                       for n in (*_INT_INPUTS, "embedding")}
        self.outputs = {n: device_zeros(_shape(session, n, True), np.float32, graphs.device) for n in _OUTPUTS}
        self.binding = session.io_binding()
        for name, value in (*self.inputs.items(), *graphs.lanes.items()):
            self.binding.bind_ortvalue_input(name, value)
        for name, value in self.outputs.items():
            self.binding.bind_ortvalue_output(name, value)
        self.options = ort.RunOptions()
        if graphs.capture:
            self.options.add_run_config_entry("gpu_graph_id", str(GRAPH_ID_BASE + graph_id))


@dataclass(eq=False)  # compared by identity (list.remove), not by its arrays
class _Pending:
    lane: EncoderLane
    call: EncoderCall
    future: Future[EncoderOut] = field(default_factory=Future)


@dataclass
class EncoderBatchStats:
    replays: int = 0
    rows: int = 0
    shared_replays: int = 0
    peak_batch: int = 0
    fresh: int = 0  # voice seeds that found their lane as the voice's last stream there left it: nothing written
    refreshes: int = 0  # lanes given back with their voice's conv histories written again

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class BatchEncoderGraphs(SlotPool[EncoderLane]):
    """The batched encoder sessions, their lane buffers and the calls waiting for a turn.
    `__call__` is an EncoderCacheFactory: a lane while one is free, else `fallback`."""

    def __init__(self, sessions: Mapping[tuple[int, int], OrtSession], device: tuple[str, int],
                 copier: DeviceCopier, spec: EncoderCacheSpec, thread: GraphThread,
                 fallback: EncoderCacheFactory) -> None:
        if not sessions:
            raise ValueError("no batched encoder graphs")
        first = next(iter(sessions.values()))
        enc = _shape(first, "enc_lanes")
        super().__init__(enc[0], thread)
        self.device = device
        self.copier = copier
        self.spec = spec
        self.fallback = fallback
        self.cache_tokens = enc[1]
        self.windows = sorted({t for _, t in sessions})
        self.batch_sizes = sorted({b for b, _ in sessions})
        self.capture = all(s.cuda_graph for s in sessions.values())
        self.lanes = {n: device_zeros(_shape(first, n), np.float32, device) for n in _LANES}
        self._lane_bytes = {n: int(np.prod(v.shape()[1:])) * 4 for n, v in self.lanes.items()}
        self._row_bytes = {n: int(np.prod(v.shape()[2:])) * 4 for n, v in self.lanes.items()}
        self.io = {key: _BatchIO(s, self, i) for i, (key, s) in enumerate(sorted(sessions.items()))}
        self._zeros = {n: device_zeros(_shape(first, n)[1:], np.float32, device) for n in ("pre_lanes", "upconv_lanes")}
        # lane index -> the voice whose prefix rows and conv histories the lane holds, as a seed or its last
        # stream's end (`refresh`) left them (None: histories not zero, no voice's for sure: a write that
        # failed midway); a lane not here has zero histories (a reset's, or never used)
        self._held: dict[int, weakref.ref[EncoderPrefix] | None] = {}
        self._queue_lock = threading.Lock()  # the calls waiting (SlotPool's own lock guards the lanes)
        self._turns = TurnQueue[_Pending](thread, self._serve, "flow_encoder_batched_replay", self._queue_lock,
                                          inline=True)  # on the graph thread: a turn would wait for itself
        self.stats = EncoderBatchStats()

    def warm_up(self) -> None:
        """On the graph thread, before any request: the lanes, and each graph run CAPTURE_RUNS times
        (onnxruntime captures on the last). A refusal disables them."""
        self.thread.call(self._warm_up)

    def _warm_up(self) -> None:
        lane_bytes = sum(self._lane_bytes.values())
        while self.slot_count < self.max_slots:
            self.register(EncoderLane(self.slot_count, lane_bytes))
        self.guarded(self._capture, "batched flow encoder graphs")

    def _capture(self) -> None:
        for io in self.io.values():
            for _ in range(CAPTURE_RUNS if self.capture else 1):
                io.session.run_bound(io.binding, io.options)

    def __call__(self, session: Session, spec: EncoderCacheSpec) -> EncoderCache:
        lane = self.take_slot() if spec == self.spec and self.disabled is None else None
        if lane is None:
            return self.fallback(session, spec)
        return BatchedEncoderCache(self, lane, session)

    def replay(self, work: Callable[[], ResultT], what: str) -> ResultT | None:
        """`work` (BatchedEncoderCache._replay: it queues the call and waits for its turn) on the caller's
        thread, under SlotPool's rule (a SynthesisError disables the graphs: None)."""
        return self.guarded(work, what)

    @property
    def waiting(self) -> int:
        """Calls waiting for a turn (tests, logs)."""
        return self._turns.waiting

    def run(self, lane: EncoderLane, call: EncoderCall) -> EncoderOut:
        """The call's mu and spks, from a replay it may share with other streams' calls."""
        pending = _Pending(lane, call)
        self._turns.queue(pending)
        return pending.future.result()

    def _serve(self) -> None:
        """On the graph thread: one replay of the calls waiting (the oldest first; an empty group where
        this turn's call was served by an earlier one)."""
        batch = self._turns.take(lambda pending: pending[:self.batch_sizes[-1]])
        self._turns.settle(batch, lambda: self._counted(batch))

    def _counted(self, batch: list[_Pending]) -> list[EncoderOut]:
        """The group's replay, counted in the stats before its callers get their rows."""
        outs = self._replay(batch)
        self.thread.note(f"rows {len(batch)}")
        with self._queue_lock:
            s = self.stats
            s.replays += 1
            s.rows += len(batch)
            s.shared_replays += len(batch) > 1
            s.peak_batch = max(s.peak_batch, len(batch))
        return outs

    def _replay(self, batch: list[_Pending]) -> list[EncoderOut]:
        """Inputs in, one replay, each row's committed rows and histories into its lane; mu, spks."""
        b = padded_size(len(batch), self.batch_sizes)
        io = self.io[(b, self.windows[max(p.call.window for p in batch)])]
        token = np.zeros((b, io.window), np.int64)
        ints = {n: np.zeros(b, np.int64) for n in ("token_len", "lookahead_len", "cached_len", "commit_tokens")}
        lane = np.full(b, batch[0].lane.index, np.int64)  # padded rows read a real lane; nothing of theirs is kept
        embedding = np.zeros((b, int(io.inputs["embedding"].shape()[1])), np.float32)
        for row, p in enumerate(batch):
            c = p.call
            token[row, :c.tokens.shape[0]] = c.tokens
            ints["token_len"][row], ints["lookahead_len"][row] = c.tokens.shape[0], c.lookahead
            ints["cached_len"][row], ints["commit_tokens"][row] = c.cached, c.commit
            lane[row] = p.lane.index
            embedding[row] = c.embedding
        io.inputs["token"].update_inplace(token)
        io.inputs["lane"].update_inplace(lane)
        io.inputs["embedding"].update_inplace(embedding)
        for name, values in ints.items():
            io.inputs[name].update_inplace(values)
        io.session.run_bound(io.binding, io.options)
        self.replays += 1
        self.copier.copy_many([copy for row, p in enumerate(batch) for copy in self._commits(io, row, p)])
        r = self.spec.token_mel_ratio
        mu, spks = io.outputs["mu"].numpy(), io.outputs["spks"].numpy()
        return [(np.array(mu[row:row + 1, :, :r * (p.call.tokens.shape[0] - p.call.lookahead)]),
                 np.array(spks[row:row + 1])) for row, p in enumerate(batch)]

    def _commits(self, io: _BatchIO, row: int, p: _Pending) -> list[tuple[int, int, int]]:
        """(dst, src, bytes) device copies of a row's committed K/V rows and conv histories."""
        c = p.call
        if not c.commit:
            return []
        copies = []
        for lanes, window, per_token in (("enc_lanes", "enc_window", 1), ("up_lanes", "up_window",
                                                                          self.spec.token_mel_ratio)):
            row_bytes = self._row_bytes[lanes]
            src = int(io.outputs[window].data_ptr()) + row * per_token * io.window * row_bytes
            copies.append((self._lane_ptr(lanes, p.lane) + per_token * c.cached * row_bytes, src,
                           per_token * c.commit * row_bytes))
        for lanes, out in (("pre_lanes", "pre_cache_new"), ("upconv_lanes", "upconv_cache_new")):
            size = self._lane_bytes[lanes]
            copies.append((self._lane_ptr(lanes, p.lane), int(io.outputs[out].data_ptr()) + row * size, size))
        return copies

    def _lane_ptr(self, name: str, lane: EncoderLane) -> int:
        return int(self.lanes[name].data_ptr()) + lane.index * self._lane_bytes[name]

    # --- a lane's own rows (BatchedEncoderCache) ---------------------------------------------------
    def read_back(self, lane: EncoderLane, tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        spec, r = self.spec, self.spec.token_mel_ratio
        out = []
        for name, frames, shape in (("enc_lanes", tokens, spec.enc_row), ("up_lanes", r * tokens, spec.up_row),
                                    ("pre_lanes", 1, spec.pre_shape[1:]), ("upconv_lanes", 1, spec.upconv_shape[1:])):
            scratch = device_zeros((max(frames, 1), *shape), np.float32, self.device)
            nbytes = frames * self._row_bytes[name] if name in ("enc_lanes", "up_lanes") else self._lane_bytes[name]
            self.copier.copy(int(scratch.data_ptr()), self._lane_ptr(name, lane), nbytes)
            out.append(np.array(scratch.numpy()[:frames]))
        return out[0], out[1], out[2], out[3]

    def seed(self, lane: EncoderLane, prefix: EncoderPrefix) -> None:
        self._held[lane.index] = None
        for rows, name in ((prefix.enc, "enc_lanes"), (prefix.up, "up_lanes")):
            copy_prefix(self.copier, self._lane_ptr(name, lane), rows, np.float32)
        self._write_histories(lane, prefix)

    def _write_histories(self, lane: EncoderLane, prefix: EncoderPrefix) -> None:
        self._held[lane.index] = None
        for history, name in ((prefix.pre, "pre_lanes"), (prefix.upconv, "upconv_lanes")):
            value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(history, np.float32), *self.device)
            self.copier.copy(self._lane_ptr(name, lane), int(value.data_ptr()), self._lane_bytes[name])
        self._held[lane.index] = weakref.ref(prefix)

    def seat_fresh(self, lane: EncoderLane, prefix: EncoderPrefix) -> bool:
        """Whether the lane holds `prefix` as a seed writes it (its rows and conv histories): then a seed
        of it would write nothing (counted in `fresh`)."""
        held = self._held.get(lane.index)
        if held is None or held() is not prefix:  # (not a voice's for sure, or another's)
            return False
        with self._queue_lock:
            self.stats.fresh += 1
        return True

    def seed_free(self, prefix: EncoderPrefix) -> int:
        """A saved voice's encoder prefix into every free lane, on the graph thread (prepare_voice, with the
        flow lanes' FlowLanes.seed_free_lanes), so its first streams find their lanes fresh; how many. A
        prefix that leaves no room for a window seeds none."""
        if self.disabled is not None or not prefix_fits(prefix.tokens, self.windows, self.cache_tokens):
            return 0
        lanes = []
        while (lane := self.take_slot()) is not None:  # taken while they are written
            lanes.append(lane)
        def seed_all() -> None:
            for lane in lanes:
                self.seed(lane, prefix)

        try:
            if lanes:
                self.thread.call(seed_all, label="flow_encoder_seed")
        finally:
            for lane in lanes:
                self.release(lane)
        return len(lanes)

    def dirty(self, lane: EncoderLane) -> bool:
        """Whether the lane's conv histories are a voice's, not zero (a stream without one resets it first)."""
        return lane.index in self._held

    def refresh(self, lane: EncoderLane, prefix: EncoderPrefix) -> None:
        """A lane whose stream of `prefix` ended, back as its seed left it: the voice's conv histories
        written again (its rows are intact: a stream writes past them), so that the voice's next stream
        there writes nothing, and takes no graph-thread turn, as the flow lanes (lanes.py)."""
        self._write_histories(lane, prefix)
        with self._queue_lock:
            self.stats.refreshes += 1

    def reset(self, lane: EncoderLane) -> None:
        """The lane's conv histories zeroed for its next stream (its free K/V rows are masked)."""
        self.copier.copy_many([(self._lane_ptr(n, lane), int(z.data_ptr()), self._lane_bytes[n])
                               for n, z in self._zeros.items()])
        self._held.pop(lane.index, None)

    def close(self) -> None:
        self.drop_slots()


class BatchedEncoderCache(PooledEncoderCache[EncoderLane]):
    """EncoderCache on a lane of the batched graphs; moves to a HostEncoderCache over the dynamic
    graph when a call does not fit the fixed shapes."""

    def __init__(self, graphs: BatchEncoderGraphs, lane: EncoderLane, dynamic: Session) -> None:
        super().__init__(graphs, lane, dynamic, graphs.spec)
        self._graphs = graphs
        self._seeding: QueuedOnce | None = None  # preload's seed, queued on the graph thread
        self._voice: EncoderPrefix | None = None  # the seed's, refreshed into the lane at the stream's end
        self._dirty = graphs.dirty(lane)  # a voice's histories left there: zeroed before a use without a seed

    def encode(self, tokens: np.ndarray, embedding: np.ndarray, lookahead: int,
               commit: int) -> tuple[np.ndarray, np.ndarray]:
        if self._seeding is not None:  # the lane's first use: its seed first (an error of it raises here)
            self._seeding.run()
            self._seeding = None
        if self._dirty and self._slot is not None:  # a stream without a voice after one with it
            self._graphs.reset(self._slot)
        self._dirty = False
        return super().encode(tokens, embedding, lookahead, commit)

    def _replay(self, slot: EncoderLane, call: EncoderCall) -> EncoderOut:
        return self._graphs.run(slot, call)

    def _read_back(self, slot: EncoderLane, tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return self._graphs.read_back(slot, tokens)

    def _seed(self, slot: EncoderLane, prefix: EncoderPrefix) -> None:
        self._voice, self._dirty = prefix, False
        if self._graphs.seat_fresh(slot, prefix):  # as the voice's last stream there left it: no write, no turn
            return
        # Queued, not awaited: a stream opens its encoder lane before its LLM starts, and the seed's
        # synchronous uploads and copies stood before the LLM of every stream opening at once.
        self._seeding = QueuedOnce(functools.partial(self._graphs.seed, slot, prefix))
        self._seeding.queue(self._graphs.thread, "flow_encoder_seed")

    def _reset(self, slot: EncoderLane) -> None:
        # the stream's end (or its move): the voice's histories again where its seed was written, else zero
        seeded = True
        if self._seeding is not None:  # one that never ran (the stream ended before its first call) or failed
            seeded = self._seeding.cancel()
            self._seeding = None
        voice, self._voice = self._voice, None
        if voice is not None and seeded:
            self._graphs.refresh(slot, voice)
        else:
            self._graphs.reset(slot)


def batch_encoder_sessions(bundle: Bundle, load: Callable[[str, Path], Session]) -> dict[tuple[int, int], Session]:
    """The bundle's batched encoder graphs (`flow_encoder_batch_b<B>_t<T>`) by (batch size, window
    tokens), loaded; refused where they disagree with each other or with the bundle's chunk."""
    found = batched_stages(bundle, BATCH_ENCODER_NAME, load)
    entries = [bundle.stages[f"{BATCH_ENCODER_PREFIX}{b}_t{t}"].raw for b, t in found]
    shapes = {(int(e.get("lanes", -1)), int(e.get("cache_tokens", -1)), int(e.get("chunk_tokens", -1)))
              for e in entries}
    if len(shapes) > 1 or any(chunk != bundle.flow.chunk_tokens for _, _, chunk in shapes):
        raise BundleError(f"{bundle.root}: batched encoder graphs with (lanes, cache tokens, chunk) {sorted(shapes)} "
                          f"(the bundle streams {bundle.flow.chunk_tokens}-token chunks); re-export")
    return found
