"""A request the bridge has taken, and when its first chunk is due. Pure logic."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from cosyedge_cloud.bridge.admission import Key
from cosyedge_cloud.wire.mqtt import ReceivedProperties
from cosyedge_cloud.wire.protocol import CloudRequest, now_unix_ms


@dataclass
class Job:
    key: Key
    device_id: str
    request: CloudRequest
    received: float  # time.monotonic()
    first_chunk_by: float | None  # time.monotonic(); None: no deadline
    redelivered: bool
    correlation: bytes | None = None
    cancel: threading.Event = field(default_factory=threading.Event)


def first_chunk_deadline(request: CloudRequest, props: ReceivedProperties, now: float) -> float | None:
    limits = []
    expiry = props.message_expiry_s
    if expiry is not None:
        # what is left of the expiry when the broker forwarded it: no clock sync needed
        limits.append(now + float(expiry))
    if request.deadline_unix_ms is not None:
        limits.append(now + (request.deadline_unix_ms - now_unix_ms()) / 1e3)
    return min(limits) if limits else None
