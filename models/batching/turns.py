"""The queue-and-turn mechanics that the batched flow lanes (flow_batcher.py), the batched encoder windows
(batched_encoder.py) and the batched vocoder (batched_vocoder.py) share.

A caller queues its call (which carries the Future it waits on) and submits a turn on the engine's GPU
graph thread at its own priority (GraphThread.submit takes the calling thread's: a first chunk's stays
first-audio work). A turn takes a group of the calls waiting then (the owner's selection rule), runs
them as one replay (the owner's), and hands each call its result, or the replay's exception to every
call of the group. Every call has a turn, and a turn whose call an earlier turn served finds nothing
to take: a no-op."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Generic, Protocol, TypeVar

from cosyedge_models.backends.graph_thread import GraphThread

log = logging.getLogger(__name__)

ResultT = TypeVar("ResultT")


class QueuedCall(Protocol[ResultT]):
    """A queued call: its caller waits on `future`."""

    @property
    def future(self) -> Future[ResultT]: ...


CallT = TypeVar("CallT", bound=QueuedCall[Any])


# a turn's note in the graph thread's trace (GraphThread.note) where its call was served by an earlier turn
EMPTY_TURN = "none (served by an earlier turn)"


class TurnQueue(Generic[CallT]):
    """The calls waiting for a turn on `thread`, and the turns that serve them. `serve` is the owner's
    turn: it takes a group (`take`, or `pending` under `lock`) and `settle`s it. `lock` may be the
    owner's own (its stats, its other state), `arrived` is a Condition on it. `inline`: a call queued on
    the graph thread itself runs the turns there until it is served (a submitted turn would wait behind
    the work that queued the call)."""

    def __init__(self, thread: GraphThread, serve: Callable[[], None], label: str,
                 lock: threading.Lock | None = None, *, inline: bool = False) -> None:
        self.thread = thread
        self.label = label  # the turns' label in the graph thread's busy time (order_stats)
        self.lock = lock if lock is not None else threading.Lock()
        self.arrived = threading.Condition(self.lock)  # a call was queued (a turn may wait for a partner)
        self._serve = serve
        self._inline = inline
        self._pending: list[CallT] = []

    @property
    def pending(self) -> list[CallT]:
        """The calls waiting, oldest first: the list itself, read and changed holding `lock`."""
        return self._pending

    @property
    def waiting(self) -> int:
        """Calls waiting for a turn (tests, logs)."""
        with self.lock:
            return len(self._pending)

    def queue(self, call: CallT) -> None:
        """`call` queued and a turn submitted for it; on return the caller waits on `call.future` (served
        already where the turns ran inline). A submit that raises (the thread is closed) takes the call
        back out: no turn would serve it."""
        with self.lock:
            self._pending.append(call)
            self.arrived.notify_all()
        if self._inline and self.thread.on_thread():
            while not call.future.done():
                self._serve()
            return
        try:
            self.thread.submit(self._serve, label=self.label)
        except BaseException:
            with self.lock:
                self._drop([call])
            raise

    def take(self, select: Callable[[list[CallT]], Sequence[CallT]]) -> list[CallT]:
        """The group `select` picks among the calls waiting (oldest first; never called with none),
        taken out of the queue; empty where this turn's call was served by an earlier turn."""
        with self.lock:
            if not self._pending:
                return []
            group = list(select(self._pending))
            self._drop(group)
        return group

    def settle(self, group: Sequence[QueuedCall[ResultT]], replay: Callable[[], Sequence[ResultT]]) -> None:
        """`replay()` for the group, outside the lock: each call gets its row of the outputs, or every
        call the exception. An empty group (nothing was waiting) runs nothing."""
        if not group:
            self.thread.note(EMPTY_TURN)
            return
        try:
            outs = replay()
        except BaseException as exc:
            for call in group:
                call.future.set_exception(exc)
            return
        for call, out in zip(group, outs, strict=True):
            call.future.set_result(out)

    def _drop(self, group: Sequence[CallT]) -> None:
        # by identity: the calls hold arrays, whose == is elementwise
        taken = {id(call) for call in group}
        self._pending[:] = [call for call in self._pending if id(call) not in taken]


class QueuedOnce:
    """Device work queued for the graph thread and not awaited (a lane's seed while the stream's LLM
    starts), run once by whichever comes first: the graph thread's turn or the stream's first use
    (`run`, which then raises the work's error). `cancel`: the stream ended first, it never runs. The
    first use may come on the graph thread itself, where waiting for the turn would wait forever."""

    def __init__(self, work: Callable[[], None]) -> None:
        self._work = work
        self._lock = threading.Lock()
        self._state = "pending"  # pending | done | failed | cancelled
        self._error: BaseException | None = None

    def queue(self, thread: GraphThread, label: str) -> None:
        thread.submit(self._turn, label=label)

    def _turn(self) -> None:
        try:
            self.run()
        except Exception:  # kept for the first use, which raises it
            log.debug("%s failed on its turn", self._work, exc_info=True)

    def run(self) -> None:
        with self._lock:
            if self._state == "pending":
                try:
                    self._work()
                    self._state = "done"
                except BaseException as exc:
                    self._state, self._error = "failed", exc
            if self._error is not None:
                raise self._error

    def cancel(self) -> bool:
        """Never run, where it has not yet (waits while it runs); whether it had run and succeeded."""
        with self._lock:
            if self._state == "pending":
                self._state = "cancelled"
            return self._state == "done"
