"""The connection loop the Wyoming listeners share: hardened framing
(framing.py), a connection limit, an idle timeout, and an error event where a reply is possible. A broken or hostile
connection ends alone; the listener keeps serving everyone else."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

from cosyedge_daemon.settings.wyoming import WyomingSettings
from cosyedge_daemon.wyoming.framing import HEADER_LIMIT, FrameError, read_event, write_event
from wyoming.error import Error
from wyoming.event import Event

log = logging.getLogger(__name__)


class Handler(Protocol):
    """One connection's protocol logic."""

    async def handle(self, event: Event) -> bool:
        """False ends the connection."""
        ...

    async def closed(self) -> None:
        """The connection ended (any reason): cancel its requests."""
        ...


HandlerFactory = Callable[[asyncio.StreamWriter], Handler]


class Listener:
    """One TCP listener (the TTS server, the satellite)."""

    def __init__(self, name: str, host: str, port: int, factory: HandlerFactory, settings: WyomingSettings,
                 idle_timeout_s: float | None) -> None:
        self.name = name
        self.host = host
        self.port = port  # the bound port once started (0 in the URI: a free one)
        self.factory = factory
        self.settings = settings
        self.idle_timeout_s = idle_timeout_s
        self.connections: set[asyncio.Task[None]] = set()
        self.served = 0
        self.refused = 0
        self.frame_errors = 0
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._connection, self.host, self.port, limit=HEADER_LIMIT)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("Wyoming %s listening on tcp://%s:%d", self.name, self.host, self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self.connections):
            task.cancel()
        if self.connections:
            await asyncio.wait(list(self.connections), timeout=3)
        if self._server is not None:
            await self._server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self.connections) >= self.settings.max_connections:
            self.refused += 1
            log.warning("Wyoming %s: refusing a connection (%d open)", self.name, len(self.connections))
            await _send_error(writer, "busy", f"too many connections ({self.settings.max_connections})")
            writer.close()
            return
        self.connections.add(task)
        self.served += 1
        handler = self.factory(writer)
        try:
            await self._serve(reader, writer, handler)
        except asyncio.CancelledError:
            pass
        finally:
            self.connections.discard(task)
            try:
                await handler.closed()
            except Exception:
                log.exception("Wyoming %s: cleaning up a connection failed", self.name)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handler: Handler) -> None:
        s = self.settings
        while True:
            try:
                event = await read_event(reader, s.max_event_bytes, self.idle_timeout_s, s.read_timeout_s)
            except asyncio.TimeoutError:
                log.info("Wyoming %s: closing a connection idle for %s s", self.name, self.idle_timeout_s)
                return
            except FrameError as exc:
                self.frame_errors += 1
                log.warning("Wyoming %s: broken frame (%s): %s", self.name, exc.code, exc.message)
                await _send_error(writer, exc.code, exc.message)
                return
            except (ConnectionError, OSError):
                return
            if event is None:
                return
            try:
                if not await handler.handle(event):
                    return
            except (ConnectionError, OSError):
                return
            except Exception as exc:  # a bug or a bad event: answer it, keep the connection
                log.exception("Wyoming %s: handling %s failed", self.name, event.type)
                await _send_error(writer, "internal", f"handling '{event.type}' failed: {exc}")


async def _send_error(writer: asyncio.StreamWriter, code: str, text: str) -> None:
    """Best effort: the peer may be gone or not reading."""
    with contextlib.suppress(asyncio.TimeoutError, ConnectionError, OSError, RuntimeError):
        await asyncio.wait_for(write_event(Error(text=text, code=code).event(), writer), 2.0)
