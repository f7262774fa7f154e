"""Concurrent streams' estimator windows as one batched replay on the engine's
GPU graph thread, over the batched fixed-shape graphs (batched_flow.py's
BatchFlowGraphs), with the fixed-shape flow path on (`graph_flow`) and
`graph_flow_batch`.

A stream's Euler step k keeps its estimator cache in a lane of group k (one
group per Euler step of the bundle), so streams at the same Euler step can
share a replay (at their largest window, the shorter ones padded). Every call is one piece of work on
the graph thread, submitted with its caller's priority (a first chunk's flow,
inside `first_audio()`, stays FIRST_AUDIO: graph_thread.py's GraphWorkOrder);
a piece that runs is one replay: flow_order.py picks its calls among those
waiting then (the highest priority waiting, then the lowest Euler step, so that
streams out of phase catch up and then share each step; a stream passed over
too often goes next), pads them to the next exported batch size (a call alone
runs the batch-1 graph at its own lane, as a stream alone ran before), and
hands each caller its rows. A piece whose call an earlier piece served is a
no-op; every call has a piece, and every piece that runs serves a call, so
none is left behind. Streams join when they take lanes and leave when they give
them back, between windows.

Where a stream's step does not fit (no free lane in its group, a window beyond
the largest, a cache past the batched frames, an fp16 cache), it runs as
before: today's single-stream fixed-shape slot (the fallback factory), or the
dynamic graph once its cache has outgrown the fixed shapes (moved by a host
round trip: rare). The engine lets in no more streams than the lanes and the
single-stream slots (seats.py), so the dynamic graph does not serve a stream
for want of a lane."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
from cosyedge_models.backends.base import Session
from cosyedge_models.backends.fixed_shapes import CFG_ROWS, bucket, prefix_fits, trim_copy, visible_first
from cosyedge_models.backends.flow_cache import PrefixRows, StepCache, StepCacheSpec
from cosyedge_models.backends.graph_thread import GraphPriority, GraphThread
from cosyedge_models.backends.ort import OrtSession
from cosyedge_models.backends.ort_cache import BoundStepCache, DeviceCopier
from cosyedge_models.batching.batched_flow import BatchFlowGraphs, SlotCall
from cosyedge_models.batching.flow_order import (
    Served,
    WaitingCall,
    coming_back,
    next_group,
    single_reason,
    take,
    worth_waiting,
)
from cosyedge_models.batching.lanes import FlowLanes, lane_history
from cosyedge_models.batching.turns import EMPTY_TURN, TurnQueue
from cosyedge_models.errors import SynthesisError

log = logging.getLogger(__name__)

CacheFactory = Callable[[Session, StepCacheSpec], StepCache]  # as models/synthesis/flow.py's


@dataclass
class FlowBatchStats:
    """What the batching did (bench output, tests)."""

    replays: int = 0  # batched-graph replays
    rows: int = 0  # stream windows they served
    shared_replays: int = 0  # replays that served more than one stream
    peak_batch: int = 0  # most streams in one replay
    fallbacks: int = 0  # step caches that took the single-stream path (no lane, other shapes)
    moves: int = 0  # step caches moved to the dynamic graph (outgrew the fixed shapes)
    batch_sizes: dict[int, int] = field(default_factory=dict)  # streams per replay -> replays
    replay_s: dict[int, float] = field(default_factory=dict)  # streams per replay -> seconds in those replays
    partner_wait_s: float = 0.0  # the graph thread's waits for a stream of the last replay (PARTNER_WAIT_S)
    windows: dict[int, int] = field(default_factory=dict)  # the replay's window frames -> replays
    mixed_windows: int = 0  # replays whose calls had windows of more than one bucket (padded to the largest)
    # replays that served one stream, by what else waited then: nothing, or calls at other Euler steps
    # (why a level's replays did not share)
    singles: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {"replays": self.replays, "rows": self.rows, "shared_replays": self.shared_replays,
                "peak_batch": self.peak_batch, "fallbacks": self.fallbacks, "moves": self.moves,
                "batch_sizes": dict(sorted(self.batch_sizes.items())),
                # the wall time of the replays serving that many streams (inputs in, replay, outputs out)
                "replay_ms": {n: round(self.replay_s[n] * 1e3, 1) for n in sorted(self.replay_s)},
                "partner_wait_ms": round(self.partner_wait_s * 1e3, 1),
                "windows": dict(sorted(self.windows.items())), "mixed_windows": self.mixed_windows,
                "singles": dict(sorted(self.singles.items()))}


# How long a replay waits for a stream of the last replay to submit its next Euler step
# (it only updates x in between, ~0.1 ms) where that call would run next or join
# (flow_order.worth_waiting): without it the stream ahead runs alone in that gap on the idle
# graph thread and the streams drift apart step by step. A bound, not a schedule: a stream
# that does not come (its window ended early, it failed) costs at most this.
PARTNER_WAIT_S = 0.005


@dataclass
class _Pending:
    call: SlotCall
    wait: WaitingCall  # its key, stream, priority and passes: what flow_order decides on
    future: Future[np.ndarray] = field(default_factory=Future)


class FlowBatcher:
    """The lanes of a BatchFlowGraphs and the calls waiting for a replay."""

    def __init__(self, graphs: BatchFlowGraphs, thread: GraphThread) -> None:
        self.graphs = graphs
        self.thread = thread
        self.stats = FlowBatchStats()
        self._lock = threading.Lock()
        self.lanes = FlowLanes(graphs, thread, self._lock)  # which are free, their seeds and end-of-stream writes
        # the calls waiting, under the same lock (its `arrived`: a call was queued); a turn at the
        # caller's priority (first audio first)
        self._turns = TurnQueue[_Pending](thread, self._serve, "flow_batched_replay", self._lock)
        # the streams of the last replay that will come back for their next Euler step
        self._served: list[Served] = []
        self.partner_wait_s = PARTNER_WAIT_S
        self.max_passed = graphs.groups  # a stream ahead waits at most about one Euler loop

    def report(self) -> dict[str, object]:
        """FlowBatchStats as a dict, consistent (bench output), with the lanes' voice prefixes written
        (`seeds`), found still there (`reuses`: only the conv history written) and found as a seed leaves
        them (`fresh`: nothing written), and the lanes refreshed or zeroed at their stream's end (lanes.py)."""
        with self._lock:
            g, lanes = self.graphs, self.lanes
            fresh = g.fresh + lanes.fresh  # in a turn, or taken on the stream's thread
            return {**self.stats.as_dict(), "seeds": g.seeds, "reuses": g.reuses + lanes.fresh, "fresh": fresh,
                    "refreshes": lanes.refreshes, "zeroings": lanes.zeroings, "refreshes_dropped": lanes.dropped}

    @property
    def waiting(self) -> int:
        """Calls waiting for a replay (tests, logs)."""
        return self._turns.waiting

    def expect(self, streams: Sequence[int]) -> None:
        """These streams' (threads') first Euler step calls come next (a gather released them together): the
        next replay waits for them as for the streams of the last one (flow_order.worth_waiting)."""
        with self._lock:
            self._served = [*self._served, *(Served(s, -1, GraphPriority.NORMAL) for s in streams)]

    def run(self, call: SlotCall) -> np.ndarray:
        """The call's dphi_dt [2, C, T], from a replay it may share with other streams' calls."""
        w = bucket(self.graphs.windows, int(call.feeds["x"].shape[2]))
        if w is None:
            raise SynthesisError(f"a window of {call.feeds['x'].shape[2]} frames exceeds the batched windows")
        wait = WaitingCall(call.slot // self.graphs.lanes, self.graphs.windows[w], threading.get_ident(),
                           self.thread.current_priority())
        pending = _Pending(call, wait)
        self._turns.queue(pending)
        return pending.future.result()

    def _serve(self) -> None:
        """On the graph thread: one replay of the calls flow_order picks among those waiting. Its own
        section under the lock rather than TurnQueue.take: it waits there for a partner, and the calls
        it leaves waiting decide its stats (single_reason)."""
        with self._lock:
            pending = self._turns.pending
            if not pending:
                self.thread.note(EMPTY_TURN)
                return  # this turn's call was served by an earlier one
            start = time.monotonic()
            deadline = start + self.partner_wait_s
            while (worth_waiting([p.wait for p in pending], self._served, self.max_passed)
                   and (left := deadline - time.monotonic()) > 0):
                self._turns.arrived.wait(left)
            self.stats.partner_wait_s += time.monotonic() - start
            waiting = [p.wait for p in pending]
            group = next_group(waiting, self.max_passed)
            assert group is not None
            batch = [pending[i] for i in take(waiting, group, self.graphs.lanes)]
            for p in batch:
                pending.remove(p)
            reason = single_reason([p.wait for p in pending]) if len(batch) == 1 else None
            self._served = coming_back([p.wait for p in batch], self.graphs.groups)
        self._turns.settle(batch, lambda: self._replay(batch, reason))

    def _replay(self, batch: list[_Pending], reason: str | None) -> list[np.ndarray]:
        """The group's replay, counted in the stats before its callers get their rows."""
        t0 = time.perf_counter()
        outs = self.graphs.run([p.call for p in batch])
        took = time.perf_counter() - t0
        n = len(batch)
        windows = {p.wait.window for p in batch}
        self.thread.note(f"rows {n}, step {batch[0].wait.group}, window {max(windows)}")
        with self._lock:
            s = self.stats
            s.replay_s[n] = s.replay_s.get(n, 0.0) + took
            s.replays += 1
            s.rows += n
            s.shared_replays += n > 1
            s.peak_batch = max(s.peak_batch, n)
            s.batch_sizes[n] = s.batch_sizes.get(n, 0) + 1
            s.windows[max(windows)] = s.windows.get(max(windows), 0) + 1
            s.mixed_windows += len(windows) > 1
            if reason is not None:
                s.singles[reason] = s.singles.get(reason, 0) + 1
        return outs


class BatchedStepCache:
    """StepCache on a lane of the batched graphs; moves to a BoundStepCache over the dynamic
    graph (host round trip) when a call does not fit the fixed shapes."""

    def __init__(self, batcher: FlowBatcher, slot: int, dynamic: OrtSession, spec: StepCacheSpec,
                 copier_cache: CacheFactory) -> None:
        self.spec = spec
        self._batcher = batcher
        self._graphs = batcher.graphs
        self._slot: int | None = slot
        self._dynamic = dynamic
        self._moved: StepCache | None = None
        self._bound = copier_cache  # makes the dynamic-graph cache (BoundStepCache)
        self._closed = False
        # the lane as its last stream gave it back (lanes.py): zeroed, or a voice's, which a stream without
        # that voice zeroes at its first use unless preload seeds it; the seed is queued on the graph thread,
        # and `length` needs neither (the slot's committed frames are 0 from acquire until the seed)
        self._needs_reset = not batcher.graphs.zeroed(slot)
        self._seeding: Future[None] | None = None
        self._voice: tuple[PrefixRows, np.ndarray] | None = None  # the seed's rows and history (the refresh)

    def _seeded(self) -> None:
        """Wait for a queued seed; one that failed raises here at every use (the lane is not trusted)."""
        if self._seeding is not None:
            self._seeding.result()
            self._seeding = None

    def _ready(self) -> None:
        """Before the lane's first replay or read: a voice's history zeroed here (a stream without a voice
        on a lane a voice's stream gave back: rare, one device copy), or the seed waited for."""
        if self._needs_reset and self._slot is not None:
            self._graphs.reset(self._slot)
        self._needs_reset = False
        self._seeded()

    @property
    def length(self) -> int:
        self._seeded()
        if self._moved is not None:
            return self._moved.length
        return self._graphs.lengths[self._slot] if self._slot is not None else 0

    @property
    def on_graph(self) -> bool:
        return self._slot is not None

    def _move(self) -> StepCache:
        """To the dynamic graph: the committed rows and the conv history through the host."""
        self._ready()
        slot = self._slot
        assert slot is not None
        kv, conv = self._batcher.thread.call(lambda: self._graphs.read_slot(slot), label="flow_lane_read")
        moved = self._bound(self._dynamic, self.spec)
        first = visible_first(kv.shape[4], self.spec.visible)
        rows = PrefixRows(np.ascontiguousarray(kv[:, :, :, :, first:].transpose(4, 0, 1, 2, 3, 5)))
        moved.preload(rows, np.ascontiguousarray(conv.transpose(1, 0, 2, 3)))
        self._give_back()
        self._moved = moved
        with self._batcher._lock:
            self._batcher.stats.moves += 1
        log.debug("batched flow cache: %d frames moved to the dynamic estimator", rows.frames)
        return moved

    def preload(self, rows: PrefixRows, conv: np.ndarray) -> None:
        """A saved voice's prefix into the lane (BatchFlowGraphs.seed on the graph thread: only the conv
        history where the lane still holds it); one that leaves no room for a window goes to the
        dynamic graph."""
        if self.length or self._moved is not None:
            raise RuntimeError("preload() on a cache that holds frames")
        slot = self._slot
        if slot is None or not prefix_fits(rows.frames, self._graphs.windows, self._graphs.cache_frames):
            self._move().preload(rows, conv)
            return
        history = lane_history(conv)
        # Queued, not awaited: a stream opens its flow (ten Euler steps' lanes) before its LLM prefill is
        # submitted, and each seed awaited in turn waited behind other streams' replays (H200, sixteenth
        # run: 259 ms of waits over eight streams' level). The lane's first use waits for it (_seeded).
        self._seeding = self._batcher.lanes.queue_seed(slot, rows, history)
        self._voice, self._needs_reset = (rows, history), False

    def run(self, feeds: Mapping[str, np.ndarray], commit: int) -> np.ndarray:
        if self._closed:
            raise RuntimeError("flow cache used after close()")
        self._ready()
        frames = int(feeds["x"].shape[2])
        if self._moved is None and self._slot is not None and not self._graphs.fits(self._slot, frames, commit):
            self._move()
        if self._moved is not None:
            return self._moved.run(feeds, commit)
        assert self._slot is not None
        first = visible_first(self.length, self.spec.visible)
        return self._batcher.run(SlotCall(self._slot, feeds, commit, first))

    def trim(self) -> None:
        if self._moved is not None:
            self._moved.trim()
            return
        slot = self._slot
        if slot is None:
            return
        self._ready()
        move = trim_copy(self.length, self.spec.visible, self._graphs.cache_frames)
        if move is None:
            return

        def shift() -> None:  # the last `keep` rows to the front (rare: bounded left context only)
            kv, conv = self._graphs.read_slot(slot)
            self._graphs.write_slot(slot, np.ascontiguousarray(kv[:, :, :, :, move.src: move.src + move.frames]),
                                    conv)
        self._batcher.thread.call(shift, label="flow_lane_trim")

    def nbytes(self) -> int:
        if self._moved is not None:
            return self._moved.nbytes()
        return 0 if self._slot is None else self._graphs.slot_bytes

    def _give_back(self) -> None:
        # the lane goes back only once nothing queued still writes it; a seed that failed before the
        # lane's first use fails nothing else (the stream closes unused)
        pending, self._seeding = self._seeding, None
        failed = pending.exception() if pending is not None else None
        if failed is not None:
            log.warning("a flow lane's seed failed before its first use: %s", failed)
        if self._slot is not None:  # with the voice's conv history again, or zeroed (lanes.py)
            self._batcher.lanes.give_back(self._slot, self._voice if failed is None else None)
            self._slot = None
        self._voice = None

    def close(self) -> None:
        self._give_back()
        if self._moved is not None:
            self._moved.close()
            self._moved = None
        self._closed = True


class BatchedFlowCaches:
    """A Backend.flow_cache: a BatchedStepCache for a stream's Euler step (StepCacheSpec.euler_step)
    while its group has a free lane and the shapes are the batched graphs', else `fallback`
    (the single-stream fixed-shape slots, or the dynamic graph)."""

    def __init__(self, batcher: FlowBatcher, fallback: CacheFactory, dynamic: CacheFactory) -> None:
        self.batcher = batcher
        self._fallback = fallback
        self._dynamic = dynamic
        g = batcher.graphs
        self._shapes = (g.blocks, g.kv_row[0], g.kv_row[2], g.conv_row)

    def matches(self, spec: StepCacheSpec) -> bool:
        blocks, _, cfg, heads, head_dim = spec.row
        convs, _, channels, history = spec.conv
        return (spec.dtype == np.float32 and cfg == CFG_ROWS
                and (blocks, heads, head_dim, (convs, channels, history)) == self._shapes)

    def __call__(self, session: Session, spec: StepCacheSpec) -> StepCache:
        if isinstance(session, OrtSession) and self.matches(spec) and spec.euler_step >= 0:
            slot = self.batcher.lanes.acquire(spec.euler_step)
            if slot is not None:
                return BatchedStepCache(self.batcher, slot, session, spec, self._dynamic)
        with self.batcher._lock:
            self.batcher.stats.fallbacks += 1
        return self._fallback(session, spec)


def dynamic_cache_factory(copier: DeviceCopier) -> CacheFactory:
    """The dynamic graph's device cache (a moved stream's), over `copier`."""
    def make(session: Session, spec: StepCacheSpec) -> StepCache:
        if not isinstance(session, OrtSession):
            raise SynthesisError(f"batched flow graphs need an onnxruntime estimator session, got {session!r}")
        return BoundStepCache(session, spec, copier)
    return make
