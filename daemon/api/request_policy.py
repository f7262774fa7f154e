"""Which MQTT v5 ResponseTopics the daemon mirrors its answers to: no
wildcards, none of the daemon's own input topics; by default none in the
namespaces it publishes in itself (its status topics, `hermes/`), and only
below `[mqtt] response_topic_prefix` when that is set. Pure logic: no I/O
here."""

from __future__ import annotations

from collections.abc import Sequence

from cosyedge_daemon.request.ids import clip
from cosyedge_daemon.settings.topics import topic_problem
from paho.mqtt.client import topic_matches_sub


class ResponseTopicPolicy:
    """Which v5 ResponseTopics the daemon mirrors answers to: publishable
    topics that none of its own subscriptions match (it would feed its answers
    back into itself) and, when `allowed_prefix` is set, only below it;
    without it, none in the `reserved` namespaces the daemon speaks itself
    (`NativeTopics.reserved`: its status topics and Hermes; a ResponseTopic
    there would let a client make the daemon speak for itself, e.g. a `done`
    JSON on hermes/tts/sayFinished, unless the deployment set the allowed
    prefix inside one of them)."""

    def __init__(
        self, own_subscriptions: Sequence[str], allowed_prefix: str = "", reserved: Sequence[str] = ()
    ) -> None:
        self.own = list(own_subscriptions)
        self.allowed_prefix = allowed_prefix.rstrip("/")
        self.reserved = list(reserved)

    def problem(self, topic: str) -> str | None:
        why = topic_problem(topic)
        if why is not None:
            return f"the ResponseTopic {clip(topic)} is refused: {why}"
        for sub in self.own:
            if topic_matches_sub(sub, topic):
                return f"the ResponseTopic {clip(topic)} is refused: it is one of the daemon's input topics ({sub})"
        p = self.allowed_prefix
        if p:  # the deployment chose where answers may go (also inside a reserved namespace)
            if topic != p and not topic.startswith(p + "/"):
                return (f"the ResponseTopic {clip(topic)} is refused: it must be below '{p}/' "
                        "([mqtt] response_topic_prefix)")
            return None
        for sub in self.reserved:
            if topic_matches_sub(sub, topic):
                return (f"the ResponseTopic {clip(topic)} is refused: the daemon publishes there itself ({sub}); "
                        "[mqtt] response_topic_prefix can allow a prefix there")
        return None
