"""`cosyedge say TEXT`: one request to a running daemon. With --out the audio
is streamed back over MQTT and written to a WAV file; without it the daemon
plays it on its speaker (or, when it has none, the audio is played here on
the default output device). Prints time to first audio and the RTF."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt
from cosyedge_cloud.wire.mqtt import MqttOptions, connect, make_client, received_properties
from cosyedge_daemon.api.tts_messages import decode_audio
from cosyedge_daemon.settings.loader import default_device_id, parse_broker_url, validate_device_id
from cosyedge_daemon.settings.topics import NativeTopics
from cosyedge_models.errors import CosyEdgeError


class _Session:
    """Collects the audio and the done/error of one request."""

    def __init__(self, topics: NativeTopics, request_id: str) -> None:
        self.topics, self.id = topics, request_id
        self.chunks: list[bytes] = []
        self.sample_rate = 0
        self.first_chunk_at: float | None = None
        self.result: tuple[str, dict[str, Any]] | None = None
        self.finished = threading.Event()

    def on_message(self, _c: Any, _u: Any, msg: mqtt.MQTTMessage) -> None:
        kind = self.topics.answer_kind(msg.topic)
        if kind == "audio":
            props = received_properties(msg).user_properties
            chunk = decode_audio(bytes(msg.payload), props)
            self.sample_rate = chunk.sample_rate
            self.chunks.append(chunk.pcm16)
            if self.first_chunk_at is None:
                self.first_chunk_at = time.monotonic()
        elif kind in ("done", "error"):
            self.result = (kind, json.loads(msg.payload))
            self.finished.set()


def _request(
    client: mqtt.Client, topics: NativeTopics, args: argparse.Namespace, output: str, timeout_s: float
) -> tuple[_Session, float]:
    session = _Session(topics, uuid.uuid4().hex)
    client.on_message = session.on_message
    sub = client.subscribe(topics.answers(session.id), qos=1)
    if sub[0] != mqtt.MQTT_ERR_SUCCESS:
        raise CosyEdgeError("could not subscribe on the broker")
    time.sleep(0.05)  # let the SUBACK land before the answer can
    body = {"id": session.id, "text": args.text, "output": output, "route": args.route}
    for key in ("voice", "mode", "instruct_text"):
        if getattr(args, key, None):
            body[key] = getattr(args, key)
    sent = time.monotonic()
    client.publish(topics.say, json.dumps(body), qos=1)
    if not session.finished.wait(timeout_s):
        raise CosyEdgeError(f"no answer within {timeout_s} s (is `cosyedge run` running for this device id?)")
    client.unsubscribe(topics.answers(session.id))
    return session, sent


def _write_wav(path: str, pcm16: bytes, rate: int) -> None:
    import soundfile

    soundfile.write(path, np.frombuffer(pcm16, dtype="<i2"), rate, subtype="PCM_16")


def _play_here(pcm16: bytes, rate: int) -> None:
    import sounddevice

    if not sounddevice.query_devices():
        raise CosyEdgeError("neither the daemon nor this machine has an audio output; use --out FILE.wav")
    sounddevice.play(np.frombuffer(pcm16, dtype="<i2"), rate, blocking=True)


def say_command(args: argparse.Namespace) -> int:
    if getattr(args, "wyoming", None):
        return _say_wyoming(args)
    addr = parse_broker_url(args.broker or "mqtt://localhost:1883")
    topics = NativeTopics(f"cosyedge/{validate_device_id(args.device_id or default_device_id())}")
    opts = MqttOptions(broker=args.broker or "mqtt://localhost:1883", client_id=f"cosyedge-say-{uuid.uuid4().hex[:8]}")
    client = make_client(opts)
    try:
        connect(client, opts)
    except OSError as exc:
        raise CosyEdgeError(f"cannot reach the broker at {addr.host}:{addr.port}: {exc}") from None
    client.loop_start()
    try:
        output = "publish" if args.out else "play"
        session, sent = _request(client, topics, args, output, args.timeout_s)
        kind, result = session.result or ("error", {})
        if kind == "error" and result.get("code") == "no_audio_device" and not args.out:
            session, sent = _request(client, topics, args, "publish", args.timeout_s)
            kind, result = session.result or ("error", {})
        if kind == "error":
            print(f"error {result.get('code')}: {result.get('message')}", file=sys.stderr)
            return 1
        pcm = b"".join(session.chunks)
        if args.out:
            _write_wav(args.out, pcm, session.sample_rate)
        elif pcm:
            _play_here(pcm, session.sample_rate)
        first = (
            (session.first_chunk_at - sent) * 1000.0
            if session.first_chunk_at is not None
            else result.get("first_audio_ms")
        )
        engine_first = (result.get("trace") or {}).get("engine_first_audio_ms")
        print(
            f"route {result.get('route')} ({result.get('engine')}); time to first audio "
            f"{_fmt(first)} ms (engine {_fmt(engine_first)} ms); RTF {result.get('rtf')}; "
            f"{result.get('audio_seconds')} s of audio" + (f" -> {args.out}" if args.out else "")
        )
        return 0
    finally:
        client.disconnect()
        client.loop_stop()


def _fmt(value: Any) -> str:
    return "?" if value is None else f"{float(value):.1f}"


def _say_wyoming(args: argparse.Namespace) -> int:
    """`cosyedge say --wyoming tcp://HOST:PORT TEXT`: as Home Assistant would ask."""
    import asyncio

    from cosyedge_daemon.wyoming.client import synthesize

    try:
        spoken = asyncio.run(synthesize(args.wyoming, args.text, voice=args.voice,
                                        stream=bool(args.wyoming_stream), timeout_s=args.timeout_s))
    except OSError as exc:
        raise CosyEdgeError(f"cannot reach the Wyoming server at {args.wyoming}: {exc}") from None
    if spoken.error is not None:
        print(f"error {spoken.error.code}: {spoken.error.text}", file=sys.stderr)
        return 1
    seconds = len(spoken.pcm16) / 2 / spoken.sample_rate if spoken.sample_rate else 0.0
    if args.out:
        _write_wav(args.out, bytes(spoken.pcm16), spoken.sample_rate)
    first = spoken.first_audio_ms
    print(f"wyoming {'streaming ' if args.wyoming_stream else ''}synthesis: time to first audio "
          f"{'?' if first is None else f'{first:.1f}'} ms; {spoken.chunks} chunks, {seconds:.2f} s of audio"
          + (f" -> {args.out}" if args.out else ""))
    return 0
