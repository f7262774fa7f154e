"""The answer path of the asyncio front ends (Wyoming, HTTP) beside the MQTT
one (daemon/api/responders.py): the event-loop thread they run on and the
Responder of their jobs. The synthesis workers call the responder on their
threads; it converts the chunk to PCM16 there and hands it to the
connection's event loop, where the job's `Channel` is read in order by the
connection. Audio a slow client has not read is bounded: beyond
`max_buffered_bytes` on one connection the job is stopped (cancelled) and
the connection closed."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from cosyedge_daemon.serving.jobs import Job
from cosyedge_models.pcm import pcm16_bytes

log = logging.getLogger(__name__)
T = TypeVar("T")


class EventLoopThread:
    """An asyncio loop on its own thread; other threads submit coroutines."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> None:
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 10.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
        if not self.loop.is_running():
            self.loop.close()


@dataclass(frozen=True)
class Audio:
    pcm16: bytes
    sample_rate: int


@dataclass(frozen=True)
class Done:
    summary: dict[str, Any]


@dataclass(frozen=True)
class Failed:
    code: str
    message: str


Item = Audio | Done | Failed


class Budget:
    """Bytes handed to one connection and not yet written (thread-safe)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._bytes = 0
        self._lock = threading.Lock()
        self.overrun = False

    def take(self, n: int) -> bool:
        with self._lock:
            self._bytes += n
            if self._bytes > self.max_bytes:
                self.overrun = True
            return not self.overrun

    def give(self, n: int) -> None:
        with self._lock:
            self._bytes -= n


class Channel:
    """One job's answers, in order, for the connection's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, budget: Budget) -> None:
        self.loop = loop
        self.budget = budget
        self.queue: asyncio.Queue[Item] = asyncio.Queue()

    def put(self, item: Item) -> None:  # any thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the connection is gone
            log.debug("dropping an answer: the event loop is closed")


class ChannelResponder:
    """The Responder of every job of one asyncio front end; the job's channel is looked up by id."""

    def __init__(self) -> None:
        self._channels: dict[str, Channel] = {}
        self._lock = threading.Lock()

    def attach(self, job_id: str, channel: Channel) -> None:
        with self._lock:
            self._channels[job_id] = channel

    def detach(self, job_id: str) -> None:
        with self._lock:
            self._channels.pop(job_id, None)

    def _channel(self, job: Job) -> Channel | None:
        with self._lock:
            return self._channels.get(job.id)

    def audio(self, job: Job, pcm: np.ndarray, sample_rate: int, seq: int, last: bool) -> None:
        channel = self._channel(job)
        if channel is None:
            job.stop("cancelled")  # nobody reads it any more
            return
        data = pcm16_bytes(pcm)
        if not channel.budget.take(len(data)):
            log.warning("the client of %s does not read its audio; cancelling", job.id)
            job.stop("cancelled")
            return
        channel.put(Audio(data, sample_rate))

    def done(self, job: Job, summary: dict[str, Any]) -> None:
        channel = self._channel(job)
        if channel is not None:
            channel.put(Done(summary))

    def error(self, job: Job, code: str, message: str) -> None:
        channel = self._channel(job)
        if channel is not None:
            channel.put(Failed(code, message))
