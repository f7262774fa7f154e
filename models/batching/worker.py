"""The worker thread both batchers run (models/batching/llm_batcher.py for the LLM,
models/batching/stage_batcher.py for flow and vocoder calls): rounds until stopped,
woken early by new work (`_kick`) and at least every idle tick, so that stop
flags, cancel events and queue delays are looked at in time."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

_W = TypeVar("_W", bound="BatchWorker")
IDLE_TICK_S = 0.25  # an idle worker looks at the stop flag (and the batchers at cancels) at least this often


class BatchWorker:
    """Start/stop and the round loop; a subclass says what one round does
    (`run_once`), what a round that raised leaves behind (`_round_failed`)
    and what is failed at stop (`_stopped`)."""

    def __init__(self, thread_name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._thread_name = thread_name
        self._cond = threading.Condition()
        self._kicked = False
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self: _W) -> _W:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._worker, name=self._thread_name, daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self._stopped()

    def __enter__(self: _W) -> _W:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def worker_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def kick(self) -> None:
        """Wake the worker (a consumer went away, new work)."""
        with self._cond:
            self._kick()

    def _kick(self) -> None:
        """New work: the worker starts a round now (call with _cond held)."""
        self._kicked = True
        self._cond.notify_all()

    # --- for subclasses ----------------------------------------------------------------
    def run_once(self) -> tuple[bool, float | None]:
        """One round: (whether anything ran, when waiting work should be looked at again)."""
        raise NotImplementedError

    def _round_failed(self, exc: Exception) -> None:
        """run_once raised (a bug: rounds fail their own work); keep nothing waiting on it."""

    def _stopped(self) -> None:
        """After the worker ended: fail what is still queued."""

    # --- the loop ----------------------------------------------------------------------
    def _worker(self) -> None:
        while True:
            try:
                worked, wake_at = self.run_once()
            except Exception as exc:
                log.exception("%s: batcher round failed", self._thread_name)
                self._round_failed(exc)
                worked, wake_at = True, None
            with self._cond:
                if self._stopping:
                    return
                if worked or self._kicked:
                    self._kicked = False
                    continue
                timeout = IDLE_TICK_S if wake_at is None else min(IDLE_TICK_S, max(0.0, wake_at - self.clock()))
                self._cond.wait(timeout)
                self._kicked = False
