"""The lanes of the batched estimator graphs (batched_flow.py's BatchFlowGraphs): which are
free, and what is written into them on the engine's graph thread around their streams.

A stream's lane needs, before its first window, its conv history zero (a stream without a saved
voice) or a saved voice's prefix and conv history (a seed). A lane is given back ready for the
next stream like it: a stream of a saved voice gives it back with the voice's conv history written
again in a queued turn (a refresh: its K/V rows still hold the prefix, streams write past them), a
stream without one with its conv history zeroed in a queued turn. The next stream of that voice then
finds the lane as a seed leaves it (BatchFlowGraphs.seat_fresh) and takes it so on its own thread,
and the next stream without a voice finds it zeroed (BatchFlowGraphs.zeroed): no write, no
graph-thread turn before its first audio. Those writes were on every first chunk's path: sixteen
streams opening together spent 115-131 ms of the graph thread writing conv histories before their
first LLM step (H100, twenty-eighth run, docs/benchmarks/h100-2026-12-07-run28.json), and turns that
wrote nothing still held it 68-84 ms among the streams' busy threads (twenty-ninth run). Other
seeds are queued, not awaited, and those waiting when the graph thread comes to them go in one
turn (BatchFlowGraphs.seed_many); a stream without a voice on a lane a voice left zeroes it at its
first use, on its own thread. A new stream that takes a lane whose end-of-stream write has not
started drops it; one being written is waited for."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
from cosyedge_models.backends.fixed_shapes import prefix_fits
from cosyedge_models.backends.flow_cache import PrefixRows
from cosyedge_models.backends.graph_thread import GraphPriority, GraphThread
from cosyedge_models.batching.batched_flow import BatchFlowGraphs

log = logging.getLogger(__name__)


def lane_history(conv: np.ndarray) -> np.ndarray:
    """A step cache's conv history [K, 2, Cmax, 2] (a prefix's, StepCache.preload's) in a lane's rows-first
    layout [2, K, Cmax, 2] (BatchFlowGraphs.seed)."""
    return np.asarray(conv, np.float32).transpose(1, 0, 2, 3)


@dataclass
class _Write:
    """A queued write of one lane: zeros (no prefix) or a seed; `done` when the turn wrote it."""

    slot: int
    rows: PrefixRows | None
    history: np.ndarray | None
    done: Future[None]


class FlowLanes:
    """The free lanes of each group and the writes queued for them. `lock` is the FlowBatcher's
    (its stats and the lanes in use are read under it too)."""

    def __init__(self, graphs: BatchFlowGraphs, thread: GraphThread, lock: threading.Lock) -> None:
        self.graphs = graphs
        self.thread = thread
        self._lock = lock
        self._free = [list(range(graphs.lanes)) for _ in range(graphs.groups)]  # lowest lane first
        self._writes: list[_Write] = []
        self._at_end: dict[int, Future[None]] = {}  # slot -> its end-of-stream write, queued or being written
        self.refreshes = 0  # lanes given back with their voice's conv history queued again
        self.zeroings = 0  # lanes given back with their conv history queued to be zeroed (no voice)
        self.dropped = 0  # end-of-stream writes a new stream took the lane before (its own write replaced them)
        self.fresh = 0  # seeds that found their lane fresh on the stream's thread (no turn: queue_seed)
        self._turns: list[Future[None]] = []  # the turns submitted and maybe not yet run (settle)

    @property
    def in_use(self) -> int:
        with self._lock:
            return self.graphs.slots - sum(len(f) for f in self._free)

    def acquire(self, group: int) -> int | None:
        """A free slot of `group` (its lowest lane: batches stay small), nothing committed; None when all
        are taken. An end-of-stream write of the lane still queued is dropped (BatchFlowGraphs.zeroed and
        seat_fresh then tell what the lane holds), one being written is waited for."""
        with self._lock:
            if not 0 <= group < self.graphs.groups or not self._free[group]:
                return None
            lane = self._free[group].pop(0)
            slot = group * self.graphs.lanes + lane
            ending = self._at_end.pop(slot, None)
            queued = ending is not None and any(w.done is ending for w in self._writes)
            if queued:
                self._writes = [w for w in self._writes if w.done is not ending]
                self.dropped += 1
        if ending is not None:
            if queued:
                ending.set_result(None)
            elif ending.exception() is not None:  # waits for its turn; what the lane holds is tracked anyway
                log.debug("a flow lane's end-of-stream write failed: %s", ending.exception())
        self.graphs.lengths[slot] = 0
        return slot

    def _free_slot(self, slot: int) -> None:
        """(under the lock) the slot's lane back among its group's free lanes, lowest first."""
        group, lane = divmod(slot, self.graphs.lanes)
        self._free[group] = sorted([*self._free[group], lane])

    def give_back(self, slot: int, voice: tuple[PrefixRows, np.ndarray] | None) -> None:
        """The lane back at its stream's end, ready for the next stream like it (the module's docstring):
        with `voice`'s conv history written again (the rows and history its seed wrote), or zeroed, in a
        queued turn; at once where it is zeroed already. Never raises (a stream's end)."""
        if voice is None and self.graphs.zeroed(slot):
            with self._lock:
                self._free_slot(slot)
            return
        rows, history = voice if voice is not None else (None, None)
        done: Future[None] = Future()
        with self._lock:
            self._at_end[slot] = done
            if voice is not None:
                self.refreshes += 1
            else:
                self.zeroings += 1
            first = not self._writes
            self._writes.append(_Write(slot, rows, history, done))
            self._free_slot(slot)
        if first:
            try:
                # never first-audio work, whatever the closing thread is doing
                self._submit(GraphPriority.NORMAL, "flow_lane_refresh")
            except BaseException as exc:  # the engine closing: the lane stays free as it is (zeroed() tells)
                log.debug("a flow lane's end-of-stream write was not queued: %s", exc)
                self._fail(exc)

    def seed_free_lanes(self, step_kv: Sequence[PrefixRows], step_conv: Sequence[np.ndarray]) -> int:
        """A saved voice's flow prefix (per Euler step: its K/V rows and conv history, a FlowPrefix's)
        into every free lane of that step's group, on the graph thread; how many lanes were seeded.
        A lane keeps the prefix for its next stream of the voice, which then writes only the conv
        history (BatchFlowGraphs.seed): without this the first streams of a voice seed their lanes
        in the requests' time (H200, 2026-12-04: 70 seeds took 1.2 s of the graph thread at eight
        cold streams). A prefix that leaves no room for a window, or of other Euler steps, seeds none."""
        g = self.graphs
        if len(step_kv) != g.groups or len(step_conv) != g.groups:
            return 0
        if not all(prefix_fits(rows.frames, g.windows, g.cache_frames) for rows in step_kv):
            return 0
        with self._lock:  # taken while they are written: no stream gets a lane half seeded
            taken = [list(free) for free in self._free]
            self._free = [[] for _ in range(g.groups)]
        items = [(group * g.lanes + lane, step_kv[group], lane_history(step_conv[group]))
                 for group, lanes in enumerate(taken) for lane in lanes]
        try:
            if items:  # one turn (seed_many: a lane that holds the prefix gets its conv history in one run)
                self.thread.call(functools.partial(g.seed_many, items), label="flow_lane_seed")
        finally:
            with self._lock:
                for group, lanes in enumerate(taken):
                    self._free[group] = sorted(self._free[group] + lanes)
        return len(items)

    def queue_seed(self, slot: int, rows: PrefixRows, history: np.ndarray) -> Future[None]:
        """A lane's seed (BatchFlowGraphs.seed) queued for the graph thread, not awaited: a stream opens
        its ten Euler steps' lanes at once, and the seeds waiting when a turn runs are written together
        (seed_many). The future fails where the turn failed (its lanes are not trusted). A lane that its
        last stream of the voice gave back refreshed is taken as it is, here: done at once, no turn (the
        voice's own read-only history is known without a look, flow_cache.same_values; anything else
        is looked at in the turn)."""
        done: Future[None] = Future()
        with self._lock:
            fresh = self.graphs.seat_fresh(slot, rows, history, look=False)
            if fresh:
                self.fresh += 1
            else:
                first = not self._writes  # else a queued turn, not yet started, takes this one too
                self._writes.append(_Write(slot, rows, history, done))
        if fresh:
            done.set_result(None)
        elif first:
            try:
                self._submit(None, "flow_lane_seed")
            except BaseException as exc:
                self._fail(exc)
        return done

    def _submit(self, priority: GraphPriority | None, label: str) -> None:
        turn = self.thread.submit(self._write_waiting, priority, label=label)
        with self._lock:
            self._turns = [t for t in self._turns if not t.done()] + [turn]

    def settle(self) -> None:
        """Wait for every turn submitted so far, counted and traced (a bench level's end-of-stream writes
        in its own figures: GraphStages.settle)."""
        with self._lock:
            turns = list(self._turns)
        for turn in turns:
            turn.exception()  # waits; a failed turn's error is its writes' (their futures carry it)

    def _write_waiting(self) -> None:
        """On the graph thread: every write waiting, in one seed_many."""
        with self._lock:
            writes, self._writes = self._writes, []
        if not writes:  # a new stream dropped the only write (acquire)
            return
        try:
            self.graphs.seed_many([(w.slot, w.rows, w.history) for w in writes])
        except BaseException as exc:
            self._settle(writes, exc)
            return
        self._settle(writes, None)

    def _settle(self, writes: Sequence[_Write], exc: BaseException | None) -> None:
        with self._lock:
            for w in writes:
                if self._at_end.get(w.slot) is w.done:
                    del self._at_end[w.slot]
        for w in writes:
            if exc is None:
                w.done.set_result(None)
            else:
                w.done.set_exception(exc)

    def _fail(self, exc: BaseException) -> None:
        """The turn could not be queued (the thread stopped): the writes waiting fail with its error."""
        with self._lock:
            writes, self._writes = self._writes, []
        self._settle(writes, exc)
