"""Helpers of the Wyoming suites: Home Assistant's side, played by the
`wyoming` package's own AsyncTcpClient on loopback, and raw sockets for
broken frames."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

from cosyedge_daemon.service.service import Service
from wyoming.client import AsyncTcpClient
from wyoming.event import Event


def tts_port(service: Service) -> int:
    assert service.wyoming is not None and service.wyoming.tts is not None
    return service.wyoming.tts.port


async def exchange(port: int, events: list[Event], until: tuple[str, ...], timeout_s: float = 20.0,
                   host: str = "127.0.0.1") -> list[Event]:
    """Send the events, then read until an event of a type in `until` (included) arrives."""
    async with AsyncTcpClient(host, port) as client:
        for e in events:
            await client.write_event(e)
        return await read_until(client, until, timeout_s)


async def read_until(client: AsyncTcpClient, until: tuple[str, ...], timeout_s: float = 20.0) -> list[Event]:
    """Read events until one of a type in `until` (included) arrives."""
    got: list[Event] = []

    async def read() -> None:
        while (e := await client.read_event()) is not None:
            got.append(e)
            if e.type in until:
                return

    await asyncio.wait_for(read(), timeout_s)
    return got


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def types(events: list[Event]) -> list[str]:
    return [e.type for e in events]


def raw_frame(kind: str, data: dict[str, Any] | None = None, payload: bytes = b"") -> bytes:
    header: dict[str, Any] = {"type": kind, "version": "1.10.2"}
    body = b""
    if data:
        body = json.dumps(data, ensure_ascii=False).encode()
        header["data_length"] = len(body)
    if payload:
        header["payload_length"] = len(payload)
    return json.dumps(header).encode() + b"\n" + body + payload


def read_raw_events(sock: socket.socket, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """Every event the server sends until it closes the connection (headers + data merged)."""
    sock.settimeout(timeout_s)
    buf = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            part = sock.recv(65536)
        except TimeoutError:
            break
        if not part:
            break
        buf += part
    return parse_events(buf)


def parse_events(buf: bytes) -> list[dict[str, Any]]:
    """The complete events in `buf` (an incomplete last one is left out)."""
    out = []
    while b"\n" in buf:
        line, rest = buf.split(b"\n", 1)
        header = json.loads(line)
        n, p = header.get("data_length", 0), header.get("payload_length", 0)
        if len(rest) < n + p:
            break
        data = json.loads(rest[:n]) if n else header.get("data", {})
        buf = rest[n + p:]
        out.append({"type": header["type"], "data": data})
    return out
