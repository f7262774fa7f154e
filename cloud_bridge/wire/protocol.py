"""The device <-> cloud protocol over MQTT, shared by the device (its
CloudSynthesizer) and the cloud bridge. Only the standard library and numpy: no
tritonclient, no paho, so the device imports it at no cost.

Topics (``root`` defaults to ``cosyedge``; everything lives under the
device's own prefix, so the broker's ``pattern readwrite cosyedge/%u/#`` ACL
authorizes a device for its own requests and responses and for nothing else):

    <root>/<device_id>/cloud/request                  device -> bridge
    <root>/<device_id>/cloud/response/<request_id>    bridge -> device

The bridge subscribes with a shared subscription
``$share/<group>/<root>/+/cloud/request`` so that replicas split the load. It
takes the device id from the topic the request came in on (which the broker
only lets that device's user write), never from the payload, and publishes
every response for it to that device's response topic only.

Request (JSON, UTF-8, QoS 1, MQTT v5 message expiry = the time the device is
willing to wait): see ``CloudRequest`` for the fields.

Responses, all on the one topic of the request (one topic keeps them in
order), QoS 1, with a message expiry so they do not pile up for a device that
is gone:

* audio: PCM16 LE mono. MQTT v5: user properties ``type=audio``, ``id``,
  ``seq`` (0, 1, ...), ``last`` (``true``/``false``), ``sample_rate``,
  ``model_version``. For MQTT v3.1.1 receivers (request field
  ``audio_header: true``) the payload starts with the 16-byte ``CEA1`` header
  of the daemon's audio topic instead: magic ``CEA1``, sample rate (uint32),
  seq (uint32), flags (uint16, bit 0 = last), reserved (uint16), little endian.
* done: JSON ``{"type": "done", "id", "model", "model_version", "chunks",
  "audio_seconds", "first_chunk_ms", "total_ms", "attempts", "redelivered",
  "times"}``.
* error: JSON ``{"type": "error", "id", "code", "message", "retryable"}``.
  Requests without a usable id are answered on ``.../cloud/response/_``.

A request the bridge received but did not finish (it crashed) is delivered
again (QoS 1, persistent session); it is then synthesized again from the
start with the same seed, so a device that already has chunks ``0..k`` drops
those and continues with ``k+1``.
"""

from __future__ import annotations

import base64
import json
import re
import struct
import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from cosyedge_models.pcm import pcm16_bytes, pcm16_to_float
from cosyedge_models.synthesis.api import MAX_TEXT_CHARS, SPEED_MAX, SPEED_MIN
from cosyedge_models.synthesis.modes import MODES, PROMPT_MODES

# The largest request payload, in bytes: the one default of the daemon's `[mqtt]
# max_payload_bytes` (a `tts/say`, prompt audio included) and, with room for the cloud
# request's own fields, of the bridge's `[limits] max_payload_bytes`. A device's cloud
# request is never larger than the say it came from plus that room (its prompt is
# re-encoded as mono PCM16, at most the size of the WAV it came in).
MAX_REQUEST_BYTES = 2_097_152
CLOUD_REQUEST_HEADROOM_BYTES = 65_536

PROTOCOL_VERSION = 1
NO_ID = "_"
# one topic level, no wildcards, no '/': usable as an MQTT user name and in topics
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")
_VERSION_RE = re.compile(r"^[1-9][0-9]{0,8}$")

# The audio chunk header, for MQTT v3.1.1 receivers (they get no user properties;
# the daemon's native API and the bridge both use it): 16 bytes little-endian,
# magic "CEA1", sample rate (uint32), sequence number (uint32), flags (uint16,
# bit 0 = last chunk), reserved (uint16, 0); PCM16 LE mono follows.
AUDIO_MAGIC = b"CEA1"
AUDIO_HEADER = struct.Struct("<4sIIHH")

# Error codes the bridge sends; `retryable` tells the device whether the same
# request may succeed later (or on another replica).
ERROR_CODES: dict[str, bool] = {
    "bad_request": False,  # malformed JSON, a missing or ill-typed field
    "too_large": False,  # payload or text over the bridge's limits
    "device_mismatch": False,  # payload device_id is not the topic's device
    "unknown_version": False,  # pinned model version not allowed / not loaded
    # the engine's own RequestError codes pass through (unknown_voice, bad_speed, ...)
    "unsupported": False,  # the deployed bundle cannot serve this (e.g. zero-shot without a speech tokenizer)
    "expired": False,  # the deadline passed before synthesis started: not synthesized
    "deadline_exceeded": False,  # no first audio by the deadline
    "busy": True,  # the bridge is at its cap on requests
    "draining": True,  # the bridge is shutting down
    "unavailable": True,  # Triton unreachable / model not ready, after retries
    "timeout": True,  # Triton stopped answering mid-request
    "model_error": False,  # the model failed at run time
}


class ProtocolError(ValueError):
    """A message that does not follow the protocol; `code` is an ERROR_CODES key."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.request_id = request_id


def valid_name(value: str) -> bool:
    return bool(_NAME_RE.match(value))


@dataclass(frozen=True)
class CloudTopics:
    root: str = "cosyedge"

    def __post_init__(self) -> None:
        if (
            not self.root
            or any(c in self.root for c in "+#")
            or self.root.startswith(("$", "/"))
            or self.root.endswith("/")
        ):
            raise ValueError(
                f"topic root {self.root!r} must be a plain topic prefix without wildcards, "
                "leading '$' or '/', or trailing '/'"
            )

    def request(self, device_id: str) -> str:
        return f"{self.root}/{device_id}/cloud/request"

    def link(self, device_id: str) -> str:
        """The retained link state a device's Mosquitto bridge publishes ("1" up, "0" down)."""
        return f"{self.root}/{device_id}/cloud/link"

    def request_filter(self) -> str:
        return f"{self.root}/+/cloud/request"

    def shared_request_filter(self, group: str) -> str:
        return f"$share/{group}/{self.request_filter()}"

    def response(self, device_id: str, request_id: str) -> str:
        return f"{self.root}/{device_id}/cloud/response/{request_id}"

    def response_filter(self, device_id: str) -> str:
        return f"{self.root}/{device_id}/cloud/response/+"

    def device_of_request(self, topic: str) -> str | None:
        """The device id of a request topic, None if the topic is not one."""
        head = f"{self.root}/"
        tail = "/cloud/request"
        if not (topic.startswith(head) and topic.endswith(tail)):
            return None
        device = topic[len(head) : -len(tail)]
        return device if valid_name(device) else None

    def request_of_response(self, device_id: str, topic: str) -> str | None:
        prefix = f"{self.root}/{device_id}/cloud/response/"
        if not topic.startswith(prefix):
            return None
        rid = topic[len(prefix) :]
        return rid if rid == NO_ID or valid_name(rid) else None


@dataclass(frozen=True)
class CloudPrompt:
    """A voice reference: PCM16 mono on the wire, float32 here."""

    pcm: np.ndarray
    sample_rate: int
    text: str = ""


@dataclass(frozen=True)
class CloudRequest:
    id: str
    text: str
    mode: str = "sft"
    voice: str | None = None
    instruct_text: str | None = None
    prompt: CloudPrompt | None = None
    model_version: str | None = None  # pin, e.g. "2"; None: the bridge's choice (default or canary)
    deadline_unix_ms: int | None = None  # first audio must be published by then (wall clock)
    stream: bool = True
    seed: int | None = None  # set it so a redelivered request resynthesizes the same audio
    speed: float = 1.0
    audio_header: bool = False  # the device reads MQTT v3.1.1: put the CEA1 header in audio chunks
    device_id: str | None = None  # optional; must equal the topic's device when given
    sent_unix_ms: int | None = None

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {
            "v": PROTOCOL_VERSION,
            "id": self.id,
            "text": self.text,
            "mode": self.mode,
            "stream": self.stream,
            "speed": self.speed,
        }
        for key in (
            "voice",
            "instruct_text",
            "model_version",
            "deadline_unix_ms",
            "seed",
            "device_id",
            "sent_unix_ms",
        ):
            value = getattr(self, key)
            if value is not None:
                doc[key] = value
        if self.audio_header:
            doc["audio_header"] = True
        if self.prompt is not None:
            doc["prompt"] = {
                "audio_b64": base64.b64encode(pcm16_bytes(self.prompt.pcm)).decode("ascii"),
                "sample_rate": self.prompt.sample_rate,
                "text": self.prompt.text,
            }
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _field(doc: dict[str, Any], key: str, kind: type | tuple[type, ...], rid: str | None, default: Any = None) -> Any:
    value = doc.get(key, default)
    if value is None:
        return default
    # bool is an int in Python; never accept it where a number is meant
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ProtocolError("bad_request", f"field '{key}' must be {_kind_name(kind)}, got a boolean", rid)
    if not isinstance(value, kind):
        raise ProtocolError("bad_request", f"field '{key}' must be {_kind_name(kind)}, got {type(value).__name__}", rid)
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", dict: "an object"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


_PEEK_ID_RE = re.compile(rb'"id"\s*:\s*"([A-Za-z0-9_.:@-]{1,128})"')


def peek_request_id(payload: bytes) -> str | None:
    """The id of a request too large to parse, from its first bytes (the
    device's encoder writes it first), so the error can still name it."""
    m = _PEEK_ID_RE.search(payload[:512])
    return m.group(1).decode() if m else None


def parse_request(payload: bytes, *, max_text_chars: int = MAX_TEXT_CHARS) -> CloudRequest:
    """Decode and validate a request; raises ProtocolError naming the field.
    The error carries the request id when one could be read."""
    try:
        doc = json.loads(payload.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ProtocolError("bad_request", f"request is not UTF-8: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ProtocolError("bad_request", f"request is not JSON: {exc.msg} at position {exc.pos}") from None
    if not isinstance(doc, dict):
        raise ProtocolError("bad_request", "request must be a JSON object")
    raw_id = doc.get("id")
    rid = raw_id if isinstance(raw_id, str) and valid_name(raw_id) else None
    if rid is None:
        raise ProtocolError("bad_request", "field 'id' is required: 1-128 characters of A-Z a-z 0-9 _ . : @ -")
    version = doc.get("v", PROTOCOL_VERSION)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            "bad_request",
            f"protocol version {version!r} is not supported (this bridge speaks v={PROTOCOL_VERSION})",
            rid,
        )
    text = _field(doc, "text", str, rid)
    if text is None or not text.strip():
        raise ProtocolError("bad_request", "field 'text' is required and must not be empty", rid)
    if len(text) > max_text_chars:
        raise ProtocolError("too_large", f"text has {len(text)} characters; the limit is {max_text_chars}", rid)
    mode = _field(doc, "mode", str, rid, "sft")
    if mode not in MODES:
        raise ProtocolError("bad_request", f"field 'mode' must be one of {', '.join(MODES)}, got {mode!r}", rid)
    instruct_text = _field(doc, "instruct_text", str, rid)
    if mode == "instruct" and not instruct_text:
        raise ProtocolError("bad_request", "mode 'instruct' needs field 'instruct_text'", rid)
    model_version = doc.get("model_version")
    if isinstance(model_version, int) and not isinstance(model_version, bool):
        model_version = str(model_version)
    if model_version is not None and (not isinstance(model_version, str) or not _VERSION_RE.match(model_version)):
        raise ProtocolError(
            "bad_request",
            f"field 'model_version' must be a positive version number such as \"2\", got {model_version!r}",
            rid,
        )
    speed = _field(doc, "speed", (int, float), rid, 1.0)
    if not SPEED_MIN <= float(speed) <= SPEED_MAX:
        raise ProtocolError(
            "bad_request", f"field 'speed' must be between {SPEED_MIN} and {SPEED_MAX}, got {speed}", rid
        )
    seed = _field(doc, "seed", int, rid)
    if seed is not None and not 0 <= seed < 2**63:
        raise ProtocolError("bad_request", "field 'seed' must be between 0 and 2**63 - 1", rid)
    device_id = _field(doc, "device_id", str, rid)
    return CloudRequest(
        id=rid,
        text=text,
        mode=mode,
        voice=_field(doc, "voice", str, rid),
        instruct_text=instruct_text,
        prompt=_parse_prompt(doc.get("prompt"), mode, rid),
        model_version=model_version,
        deadline_unix_ms=_field(doc, "deadline_unix_ms", int, rid),
        stream=_field(doc, "stream", bool, rid, True),
        seed=seed,
        speed=float(speed),
        audio_header=_field(doc, "audio_header", bool, rid, False),
        device_id=device_id,
        sent_unix_ms=_field(doc, "sent_unix_ms", int, rid),
    )


def _parse_prompt(raw: Any, mode: str, rid: str) -> CloudPrompt | None:
    if raw is None:
        if mode in PROMPT_MODES:
            raise ProtocolError(
                "bad_request", f"mode '{mode}' needs field 'prompt' ({{audio_b64, sample_rate, text}})", rid
            )
        return None
    if not isinstance(raw, dict):
        raise ProtocolError("bad_request", "field 'prompt' must be an object {audio_b64, sample_rate, text}", rid)
    audio = raw.get("audio_b64")
    rate = raw.get("sample_rate")
    text = raw.get("text", "")
    if not isinstance(audio, str) or not isinstance(rate, int) or isinstance(rate, bool) or not 8000 <= rate <= 96000:
        raise ProtocolError(
            "bad_request",
            "field 'prompt' needs 'audio_b64' (base64 PCM16 LE mono) and 'sample_rate' (an integer from 8000 to 96000)",
            rid,
        )
    if not isinstance(text, str):
        raise ProtocolError("bad_request", "field 'prompt.text' must be a string", rid)
    if mode == "zero_shot" and not text:
        raise ProtocolError("bad_request", "mode 'zero_shot' needs the prompt's transcript in 'prompt.text'", rid)
    try:
        data = base64.b64decode(audio, validate=True)
    except ValueError:
        raise ProtocolError("bad_request", "field 'prompt.audio_b64' is not valid base64", rid) from None
    if len(data) < 2 or len(data) % 2:
        raise ProtocolError(
            "bad_request",
            "field 'prompt.audio_b64' must hold PCM16 samples (an even, non-zero number of bytes)",
            rid,
        )
    pcm = pcm16_to_float(data)
    return CloudPrompt(pcm=pcm, sample_rate=rate, text=text)


# --- responses -------------------------------------------------------------------------------------


def pack_audio_header(sample_rate: int, seq: int, last: bool) -> bytes:
    return AUDIO_HEADER.pack(AUDIO_MAGIC, sample_rate, seq, 1 if last else 0, 0)


def unpack_audio_header(payload: bytes) -> tuple[bytes, int, int, bool] | None:
    """(PCM16 body, sample rate, seq, last) of a chunk that starts with the header, else None."""
    if payload[:4] != AUDIO_MAGIC or len(payload) < AUDIO_HEADER.size:
        return None
    _, rate, seq, flags, _ = AUDIO_HEADER.unpack_from(payload)
    return payload[AUDIO_HEADER.size :], rate, seq, bool(flags & 1)


@dataclass(frozen=True)
class AudioMessage:
    request_id: str
    pcm16: bytes
    sample_rate: int
    seq: int
    last: bool
    model_version: str = ""

    def pcm(self) -> np.ndarray:
        return pcm16_to_float(self.pcm16)


@dataclass(frozen=True)
class DoneMessage:
    request_id: str
    summary: dict[str, Any]


@dataclass(frozen=True)
class ErrorMessage:
    request_id: str
    code: str
    message: str
    retryable: bool


ResponseMessage = AudioMessage | DoneMessage | ErrorMessage
Properties = list[tuple[str, str]]


def encode_audio(
    request_id: str, pcm: np.ndarray, sample_rate: int, seq: int, last: bool, model_version: str, header: bool
) -> tuple[bytes, Properties]:
    """(payload, v5 user properties). With header=True the payload carries
    the CEA1 header too (MQTT v3.1.1 receivers lose the properties)."""
    body = pcm16_bytes(pcm)
    props = [
        ("type", "audio"),
        ("id", request_id),
        ("seq", str(seq)),
        ("last", "true" if last else "false"),
        ("sample_rate", str(sample_rate)),
        ("model_version", model_version),
    ]
    if header:
        props.append(("header", "true"))
        body = pack_audio_header(sample_rate, seq, last) + body
    return body, props


def encode_done(request_id: str, summary: dict[str, Any]) -> tuple[bytes, Properties]:
    doc = {"type": "done", "id": request_id, **summary}
    return json.dumps(doc, separators=(",", ":")).encode(), [("type", "done"), ("id", request_id)]


def encode_error(request_id: str | None, code: str, message: str) -> tuple[bytes, Properties]:
    rid = request_id or NO_ID
    retryable = ERROR_CODES.get(code, False)
    doc = {"type": "error", "id": request_id, "code": code, "message": message, "retryable": retryable}
    return json.dumps(doc, separators=(",", ":")).encode(), [("type", "error"), ("id", rid)]


def decode_response(payload: bytes, user_properties: Properties | None, request_id: str = NO_ID) -> ResponseMessage:
    """One response message, from v5 user properties or (v3.1.1) the payload
    alone. Raises ProtocolError on anything else."""
    props = dict(user_properties or [])
    kind: Literal["audio", "done", "error"] | str | None = props.get("type")
    if kind == "audio":
        if payload[:4] == AUDIO_MAGIC and len(payload) >= AUDIO_HEADER.size and props.get("header") == "true":
            payload = payload[AUDIO_HEADER.size :]
        try:
            return AudioMessage(
                props.get("id", request_id),
                payload,
                int(props["sample_rate"]),
                int(props["seq"]),
                props["last"] == "true",
                props.get("model_version", ""),
            )
        except (KeyError, ValueError) as exc:
            raise ProtocolError("bad_request", f"audio chunk with bad user properties: {exc}") from None
    framed = unpack_audio_header(payload) if kind is None else None
    if framed is not None:
        return AudioMessage(request_id, *framed)
    try:
        doc = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ProtocolError("bad_request", "response is neither audio nor JSON") from None
    if not isinstance(doc, dict) or doc.get("type") not in ("done", "error"):
        raise ProtocolError("bad_request", "response JSON must have type 'done' or 'error'")
    rid = doc.get("id") or request_id
    if doc["type"] == "done":
        return DoneMessage(rid, {k: v for k, v in doc.items() if k not in ("type", "id")})
    return ErrorMessage(rid, str(doc.get("code")), str(doc.get("message")), bool(doc.get("retryable")))


def now_unix_ms() -> int:
    return int(time.time() * 1000)
