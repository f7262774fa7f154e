"""Send one request over the cloud protocol, as a device would, and report
what comes back: a check of a cloud deployment (broker, ACL, bridge, Triton)
from the device's side.

    python -m cosyedge_cloud.tools.probe "Hello from the cloud." --broker mqtt://localhost:1883 \\
        --device-id kitchen --out /tmp/cloud.wav

Prints one JSON line (first chunk latency, chunks, audio seconds, the done or
error message) and exits 0 on done, 1 on an error, 2 on a timeout."""

from __future__ import annotations

import argparse
import json
import queue
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt
from cosyedge_cloud.wire.mqtt import (
    MqttOptions,
    connect,
    make_client,
    publish_properties,
    received_properties,
)
from cosyedge_cloud.wire.protocol import (
    AudioMessage,
    CloudRequest,
    CloudTopics,
    DoneMessage,
    ErrorMessage,
    ProtocolError,
    ResponseMessage,
    decode_response,
    now_unix_ms,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cosyedge_cloud.tools.probe", description=__doc__.split("\n\n")[0])
    p.add_argument("text")
    p.add_argument("--broker", default="mqtt://localhost:1883", help="mqtt://host:port or mqtts://host:port")
    p.add_argument("--device-id", default="probe")
    p.add_argument("--username", help="default: the device id when --password is given")
    p.add_argument("--password")
    p.add_argument("--ca-file", help="CA certificate for mqtts:// (default: the system's)")
    p.add_argument("--topic-root", default="cosyedge")
    p.add_argument("--voice")
    p.add_argument("--model-version", help="pin a model version, e.g. 2")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=120.0, help="also the request's message expiry")
    p.add_argument("--out", help="write the audio to this WAV file")
    return p


def probe(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    topics = CloudTopics(args.topic_root)
    rid = f"probe-{uuid.uuid4().hex[:12]}"
    inbox: queue.Queue[ResponseMessage] = queue.Queue()
    subscribed: queue.Queue[bool] = queue.Queue()

    def on_connect(client: mqtt.Client, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
        if reason.is_failure:
            subscribed.put(False)
            return
        client.subscribe(topics.response(args.device_id, rid), qos=1)

    def on_subscribe(_c: mqtt.Client, _u: Any, _m: int, reasons: list[Any], _p: Any) -> None:
        subscribed.put(not any(r.is_failure for r in reasons))

    def on_message(_c: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        user = received_properties(msg).user_properties
        try:
            inbox.put(decode_response(bytes(msg.payload), user, rid))
        except ProtocolError as exc:
            print(f"probe: unreadable response on {msg.topic}: {exc}", file=sys.stderr)

    opts = MqttOptions(
        broker=args.broker, client_id=f"{args.device_id}-{rid}", password=args.password or "",
        username=(args.username or args.device_id) if args.password else "", tls_ca_file=args.ca_file or "",
    )
    client = make_client(opts)
    client.on_connect, client.on_subscribe, client.on_message = on_connect, on_subscribe, on_message
    connect(client, opts)
    client.loop_start()
    report: dict[str, Any] = {"id": rid, "device_id": args.device_id}
    try:
        try:
            if not subscribed.get(timeout=10):
                return 1, {**report, "error": "the broker refused the connection or the subscription"}
        except queue.Empty:
            return 2, {**report, "error": f"no connection to {args.broker} within 10 s"}
        request = CloudRequest(
            id=rid,
            text=args.text,
            voice=args.voice,
            model_version=args.model_version,
            seed=args.seed,
            deadline_unix_ms=now_unix_ms() + int(args.timeout_s * 1000),
            sent_unix_ms=now_unix_ms(),
        )
        props = publish_properties(message_expiry_s=max(1, int(args.timeout_s)))
        started = time.monotonic()
        client.publish(topics.request(args.device_id), request.to_json(), qos=1, properties=props)
        chunks: list[AudioMessage] = []
        deadline = started + args.timeout_s
        while True:
            try:
                message = inbox.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                return 2, {**report, "error": f"no answer within {args.timeout_s:g} s", "chunks": len(chunks)}
            if isinstance(message, AudioMessage):
                if not chunks:
                    report["first_chunk_ms"] = round((time.monotonic() - started) * 1e3, 1)
                chunks.append(message)
                continue
            report["total_ms"] = round((time.monotonic() - started) * 1e3, 1)
            report["chunks"] = len(chunks)
            report["audio_seconds"] = round(sum(len(c.pcm16) / 2 / c.sample_rate for c in chunks), 3)
            if isinstance(message, ErrorMessage):
                return 1, {**report, "error": {"code": message.code, "message": message.message}}
            assert isinstance(message, DoneMessage)
            if args.out and chunks:
                import soundfile

                pcm = np.concatenate([c.pcm() for c in chunks])
                soundfile.write(args.out, pcm, chunks[0].sample_rate, subtype="PCM_16")
                report["out"] = args.out
            return 0, {**report, "done": message.summary}
    finally:
        client.disconnect()
        client.loop_stop()


def main(argv: Sequence[str] | None = None) -> int:
    code, report = probe(_parser().parse_args(argv))
    print(json.dumps(report))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
