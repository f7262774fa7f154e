"""What a client may put in the places the daemon echoes into topics and
logs: request ids (printable ASCII of a fixed alphabet, matched whole, so no
trailing newline slips through a `$`), the MQTT v5 ResponseTopic (no
wildcards, not one of the daemon's own input topics, optionally under an
allowed prefix), and how much of a client's value goes into an error
message. Pure functions: no I/O here."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from paho.mqtt.client import topic_matches_sub

ID_MAX_CHARS = 128
ID_ALPHABET = "A-Z a-z 0-9 _ . : @ -"
_ID_RE = re.compile(rf"[A-Za-z0-9_.:@-]{{1,{ID_MAX_CHARS}}}")
# The id at the very start of a payload (`{"id": "..."`), for answers to
# payloads that cannot be decoded as a whole (too large, broken JSON or UTF-8).
_LEADING_ID_RE = re.compile(rb'\A\s*\{\s*"id"\s*:\s*"([A-Za-z0-9_.:@-]{1,%d})"' % ID_MAX_CHARS)
_LEADING_FIELD_RE = rb'"%s"\s*:\s*"([\x20-\x21\x23-\x5b\x5d-\x7e]{1,128})"'
MAX_TOPIC_BYTES = 65535  # MQTT's limit on a topic's UTF-8 length
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


def topic_problem(topic: str) -> str | None:
    """Why the daemon must not publish on `topic` (None: it may). A topic with
    a control character is a malformed packet to the broker, which then drops
    the connection; wildcards are not allowed in a publish."""
    if not topic:
        return "it is empty"
    if "+" in topic or "#" in topic:
        return "it contains an MQTT wildcard (+ or #)"
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in topic):
        return "it contains a control character"
    try:
        size = len(topic.encode("utf-8"))
    except UnicodeEncodeError:
        return "it is not valid UTF-8"
    if size > MAX_TOPIC_BYTES:
        return f"it is longer than {MAX_TOPIC_BYTES} bytes"
    return None


class ResponseTopicPolicy:
    """Which v5 ResponseTopics the daemon mirrors answers to: publishable
    topics that none of its own subscriptions match (it would feed its answers
    back into itself) and, when `allowed_prefix` is set, only below it."""

    def __init__(self, own_subscriptions: Sequence[str], allowed_prefix: str = "") -> None:
        self.own = list(own_subscriptions)
        self.allowed_prefix = allowed_prefix.rstrip("/")

    def problem(self, topic: str) -> str | None:
        why = topic_problem(topic)
        if why is not None:
            return f"the ResponseTopic {clip(topic)} is refused: {why}"
        for sub in self.own:
            if topic_matches_sub(sub, topic):
                return f"the ResponseTopic {clip(topic)} is refused: it is one of the daemon's input topics ({sub})"
        p = self.allowed_prefix
        if p and topic != p and not topic.startswith(p + "/"):
            return f"the ResponseTopic {clip(topic)} is refused: it must be below '{p}/' ([mqtt] response_topic_prefix)"
        return None
