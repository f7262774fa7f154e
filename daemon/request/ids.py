"""What a client may put in the places the daemon echoes into topics and
logs, whichever front end it came through: request ids (printable ASCII of a
fixed alphabet, matched whole, so no trailing newline slips through a `$`)
and how much of a client's value goes into an error message or log line.
Pure functions: no I/O here."""

from __future__ import annotations

import re
from typing import Any

ID_MAX_CHARS = 128
ID_ALPHABET = "A-Z a-z 0-9 _ . : @ -"
_ID_RE = re.compile(rf"[A-Za-z0-9_.:@-]{{1,{ID_MAX_CHARS}}}")
# The id at the very start of a payload (`{"id": "..."`), for answers to
# payloads that cannot be decoded as a whole (too large, broken JSON or UTF-8).
_LEADING_ID_RE = re.compile(rb'\A\s*\{\s*"id"\s*:\s*"([A-Za-z0-9_.:@-]{1,%d})"' % ID_MAX_CHARS)
_LEADING_FIELD_RE = rb'"%s"\s*:\s*"([\x20-\x21\x23-\x5b\x5d-\x7e]{1,128})"'
ECHO_CHARS = 120  # at most this much of a client's value goes into an error message or log line


def valid_id(value: Any) -> bool:
    """An id the daemon may put into a topic: 1-128 characters of A-Z a-z 0-9 _ . : @ -."""
    return isinstance(value, str) and _ID_RE.fullmatch(value) is not None


def leading_id(payload: bytes) -> str | None:
    """The id when the payload starts with `{"id": "<valid id>"` (whatever follows)."""
    m = _LEADING_ID_RE.match(payload[: ID_MAX_CHARS + 64])
    return m.group(1).decode("ascii") if m else None


def sniff_field(payload: bytes, name: str, limit: int = 4096) -> str | None:
    """A printable-ASCII string field found near the start of an undecodable
    payload (e.g. Hermes' `siteId`), or None."""
    m = re.search(_LEADING_FIELD_RE % re.escape(name).encode(), payload[:limit])
    return m.group(1).decode("ascii") if m else None


def clip(value: object, limit: int = ECHO_CHARS) -> str:
    """`repr`-like text of a client's value, cut to `limit` characters."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
