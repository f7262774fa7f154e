"""Reading Wyoming events with limits. The `wyoming` package's reader trusts
its peer (any line length, any data/payload length, no time limit on the
body); a server on a home network must not. The format is the package's:
a JSON header line (`type`, optional `data`, `data_length`,
`payload_length`), then `data_length` bytes of JSON merged into `data`,
then `payload_length` bytes of payload. Writing uses the package itself."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from wyoming.event import Event, async_write_event

__all__ = ["HEADER_LIMIT", "FrameError", "read_event", "write_event"]

HEADER_LIMIT = 65_536  # the stream reader's line limit (asyncio.start_server(limit=...))


class FrameError(Exception):
    """A broken frame: `code` for the error event; the connection cannot go on."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _length(header: dict[str, Any], key: str, limit: int) -> int:
    value = header.get(key)
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise FrameError("invalid_header", f"'{key}' must be a non-negative integer, got {value!r}"[:200])
    if value > limit:
        raise FrameError("event_too_large", f"'{key}' is {value} bytes; the limit is {limit}")
    return value


def parse_header(line: bytes, max_bytes: int) -> tuple[str, dict[str, Any], int, int]:
    """(type, inline data, data_length, payload_length) of a header line."""
    try:
        header = json.loads(line)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FrameError("invalid_header", f"the event header is not valid JSON: {exc}"[:200]) from None
    if not isinstance(header, dict):
        raise FrameError("invalid_header", "the event header must be a JSON object")
    kind = header.get("type")
    if not isinstance(kind, str) or not kind:
        raise FrameError("invalid_header", "the event header has no 'type' string")
    data = header.get("data") or {}
    if not isinstance(data, dict):
        raise FrameError("invalid_header", "'data' must be a JSON object")
    data_len = _length(header, "data_length", max_bytes)
    payload_len = _length(header, "payload_length", max_bytes)
    if len(line) + data_len + payload_len > max_bytes:
        raise FrameError("event_too_large", f"the event has more than {max_bytes} bytes")
    return kind, data, data_len, payload_len


async def read_event(
    reader: asyncio.StreamReader, max_bytes: int, idle_timeout_s: float | None, body_timeout_s: float
) -> Event | None:
    """The next event; None at a clean end of stream; asyncio.TimeoutError when idle.
    Raises FrameError for a broken frame."""
    try:
        line = await asyncio.wait_for(reader.readuntil(b"\n"), idle_timeout_s)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise FrameError("truncated", "the connection closed inside an event header") from None
    except asyncio.LimitOverrunError:
        raise FrameError("event_too_large", f"the event header line exceeds {HEADER_LIMIT} bytes") from None
    kind, data, data_len, payload_len = parse_header(line, max_bytes)
    try:
        body = await asyncio.wait_for(reader.readexactly(data_len + payload_len), body_timeout_s)
    except asyncio.IncompleteReadError:
        raise FrameError("truncated", f"the connection closed inside the body of '{kind}'") from None
    except asyncio.TimeoutError:  # not the builtin TimeoutError on Python 3.10
        raise FrameError(
            "truncated", f"'{kind}' announced {data_len + payload_len} bytes that did not arrive "
            f"within {body_timeout_s} s"
        ) from None
    if data_len:
        try:
            extra = json.loads(body[:data_len])
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise FrameError("invalid_data", f"the data of '{kind}' is not valid JSON: {exc}"[:200]) from None
        if not isinstance(extra, dict):
            raise FrameError("invalid_data", f"the data of '{kind}' must be a JSON object")
        data = {**data, **extra}
    return Event(type=kind, data=data, payload=body[data_len:] or None)


async def write_event(event: Event, writer: asyncio.StreamWriter) -> None:
    await async_write_event(event, writer)
