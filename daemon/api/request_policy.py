"""Which MQTT v5 ResponseTopics the daemon mirrors its answers to (no
wildcards, none of the daemon's own input topics, optionally only below an
allowed prefix). Pure logic: no I/O here."""

from __future__ import annotations

from collections.abc import Sequence

from cosyedge_daemon.request.ids import clip
from cosyedge_daemon.settings.topics import topic_problem
from paho.mqtt.client import topic_matches_sub


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
