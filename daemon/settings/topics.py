"""The MQTT topics of the daemon: its native topics (`NativeTopics`, the one
place they are spelled) and what makes a topic unpublishable (the settings
check the prefix and siteIds with it, the connection every publish). Pure
functions: no I/O here."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class NativeTopics:
    """The daemon's own topics below its prefix (`cosyedge/<device_id>` unless
    `[mqtt] topic_prefix` says otherwise): the one place they are spelled, as
    the cloud's are in `cosyedge_cloud.wire.protocol.CloudTopics`."""

    prefix: str

    # --- in: what the daemon subscribes to
    @property
    def say(self) -> str:
        return f"{self.prefix}/tts/say"

    @property
    def cancel(self) -> str:
        return f"{self.prefix}/tts/cancel"

    @property
    def reload(self) -> str:
        return f"{self.prefix}/admin/reload"

    # --- out: the answers of one request
    def audio(self, request_id: str) -> str:
        return f"{self.prefix}/tts/audio/{request_id}"

    def done(self, request_id: str) -> str:
        return f"{self.prefix}/tts/done/{request_id}"

    def error(self, request_id: str) -> str:
        return f"{self.prefix}/tts/error/{request_id}"

    def answers(self, request_id: str = "+") -> str:
        """The filter of one request's answers (audio, done, error); "+": of every request."""
        return f"{self.prefix}/tts/+/{request_id}"

    def answer_kind(self, topic: str) -> str | None:
        """"audio", "done" or "error" of an answer topic; None for any other topic."""
        head = f"{self.prefix}/tts/"
        kind = topic[len(head):].split("/")[0] if topic.startswith(head) else None
        return kind if kind in ("audio", "done", "error") else None

    # --- out: the device's state and its microphone
    @property
    def status(self) -> str:
        """Retained online/offline (the connection's will)."""
        return f"{self.prefix}/status"

    @property
    def health(self) -> str:
        return f"{self.prefix}/status/health"

    @property
    def vad_event(self) -> str:
        return f"{self.prefix}/vad/event"

    @property
    def vad_segment(self) -> str:
        return f"{self.prefix}/vad/segment"

    def reserved(self) -> list[str]:
        """The filters of the namespaces the daemon speaks itself besides its
        input topics (its status topics, Hermes): the ResponseTopic policy's default refusals."""
        return [self.status, f"{self.status}/#", "hermes/#"]
