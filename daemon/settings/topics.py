"""The MQTT topics the daemon publishes on: what makes a topic unpublishable
(the settings check the prefix and siteIds with it, the connection every
publish). Pure functions: no I/O here."""

from __future__ import annotations

MAX_TOPIC_BYTES = 65535  # MQTT's limit on a topic's UTF-8 length


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
