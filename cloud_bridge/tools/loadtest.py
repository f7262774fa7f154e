"""Load test of the cloud chain: device-side MQTT client -> broker -> bridge
-> Triton (streaming) -> back. Bounded request loops at each concurrency
level; reports throughput, first-chunk and total latency percentiles, and
Triton's batch statistics from its metrics endpoint (requests / executions
= the average batch the dynamic batcher formed).

    python -m cosyedge_cloud.tools.loadtest --bundle DIR            # starts mosquitto, tritonserver and a bridge
    python -m cosyedge_cloud.tools.loadtest --broker mqtt://host:1883 --triton-metrics http://host:8002/metrics

Every request is unique (its own id), carries the same seed (the same work
each, so the levels compare), and goes out on one
device's request topic; the responses come back on that device's topic."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import re
import socket
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from cosyedge_cloud.triton.batching_config import DynamicBatching
from cosyedge_cloud.wire.mqtt import (
    MqttOptions,
    connect,
    make_client,
    publish_properties,
    received_properties,
)
from cosyedge_cloud.wire.protocol import AudioMessage, CloudRequest, CloudTopics, DoneMessage, decode_response

log = logging.getLogger(__name__)

DEFAULT_LEVELS = (1, 2, 4, 8, 16)
DEFAULT_TEXT = "Hello there."


@dataclass
class _Pending:
    sent: float
    first: float | None = None
    end: float | None = None
    ok: bool = False
    audio_s: float = 0.0
    llm_batch_max: int = 0  # the engine's: the most requests in one LLM decode step with this one
    finished: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class LevelResult:
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    throughput_rps: float
    audio_s_per_s: float
    first_chunk_ms: dict[str, float]
    total_ms: dict[str, float]
    triton_requests: float
    triton_executions: float
    llm_batch_max: int = 0  # the most requests that shared an LLM decode step at this level (engine statistics)

    @property
    def avg_batch(self) -> float:
        return self.triton_requests / self.triton_executions if self.triton_executions else 0.0


class LoadClient:
    """One MQTT v5 connection acting as a device: publishes requests and
    collects the answers per request id."""

    def __init__(self, broker: str, device_id: str, topics: CloudTopics, timeout_s: float) -> None:
        self.device_id, self.topics, self.timeout_s = device_id, topics, timeout_s
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        opts = MqttOptions(broker=broker, client_id=f"loadtest-{uuid.uuid4().hex[:8]}")
        self.client = make_client(opts)
        self.client.on_message = self._on_message
        subscribed = threading.Event()
        self.client.on_subscribe = lambda *_a: subscribed.set()
        connect(self.client, opts)
        self.client.subscribe(topics.response_filter(device_id), qos=1)
        self.client.loop_start()
        if not subscribed.wait(10):
            raise TimeoutError(f"no subscription on {broker} within 10 s")

    def _on_message(self, _c: Any, _u: Any, msg: mqtt.MQTTMessage) -> None:
        rid = self.topics.request_of_response(self.device_id, msg.topic)
        with self._lock:
            pending = self._pending.get(rid or "")
        if pending is None:
            return
        now = time.monotonic()
        answer = decode_response(bytes(msg.payload), received_properties(msg).user_properties, rid or "_")
        if isinstance(answer, AudioMessage):
            if pending.first is None:
                pending.first = now
            pending.audio_s += len(answer.pcm16) / 2 / answer.sample_rate
            return
        pending.ok, pending.end = isinstance(answer, DoneMessage), now
        if isinstance(answer, DoneMessage):
            times = answer.summary.get("times")
            pending.llm_batch_max = int(times.get("llm_batch_max") or 0) if isinstance(times, dict) else 0
        pending.finished.set()

    def request(self, text: str, seed: int) -> _Pending:
        """Send one request and wait for its done/error (or the timeout)."""
        rid = uuid.uuid4().hex
        pending = _Pending(time.monotonic())
        with self._lock:
            self._pending[rid] = pending
        props = publish_properties(message_expiry_s=int(self.timeout_s))
        body = CloudRequest(id=rid, text=text, seed=seed).to_json()
        pending.sent = time.monotonic()
        self.client.publish(self.topics.request(self.device_id), body, qos=1, properties=props)
        if not pending.finished.wait(self.timeout_s):
            pending.end = time.monotonic()
        with self._lock:
            del self._pending[rid]
        return pending

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def percentiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan}
    ordered = sorted(values)

    def pick(q: float) -> float:  # nearest rank
        return round(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))], 1)

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def triton_counts(metrics_url: str | None, model: str) -> tuple[float, float]:
    """(successful requests, executions) of `model`, summed over its versions."""
    if not metrics_url:
        return 0.0, 0.0
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    totals = {"nv_inference_request_success": 0.0, "nv_inference_exec_count": 0.0}
    for line in text.splitlines():
        m = re.match(r'^(nv_inference_request_success|nv_inference_exec_count)\{(.*)\} (\S+)$', line)
        if m and f'model="{model}"' in m.group(2):
            totals[m.group(1)] += float(m.group(3))
    return totals["nv_inference_request_success"], totals["nv_inference_exec_count"]


def run_level(
    client: LoadClient,
    concurrency: int,
    requests: int,
    text: str,
    metrics_url: str | None,
    model: str,
    seed: int = 1,
) -> LevelResult:
    """`requests` requests by `concurrency` loops, each sending the next when its last one ended."""
    counter = iter(range(requests))  # one seed for all: the same work per request
    lock = threading.Lock()
    results: list[_Pending] = []

    def loop() -> None:
        while True:
            with lock:
                n = next(counter, None)
            if n is None:
                return
            got = client.request(text, seed)
            with lock:
                results.append(got)

    req0, exec0 = triton_counts(metrics_url, model)
    start = time.monotonic()
    threads = [threading.Thread(target=loop, name=f"load-{i}") for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    req1, exec1 = triton_counts(metrics_url, model)
    ok = [r for r in results if r.ok]
    return LevelResult(
        concurrency=concurrency,
        requests=len(results),
        errors=len(results) - len(ok),
        wall_s=round(wall, 2),
        throughput_rps=round(len(ok) / wall, 3),
        audio_s_per_s=round(sum(r.audio_s for r in ok) / wall, 3),
        first_chunk_ms=percentiles([(r.first - r.sent) * 1000 for r in ok if r.first is not None]),
        total_ms=percentiles([(r.end - r.sent) * 1000 for r in ok if r.end is not None]),
        triton_requests=req1 - req0,
        triton_executions=exec1 - exec0,
        llm_batch_max=max((r.llm_batch_max for r in ok), default=0),
    )


def table(results: Sequence[LevelResult]) -> str:
    head = (
        "| concurrency | requests | errors | req/s | audio s/s | first chunk p50 / p90 / p99 ms "
        "| total p50 / p90 / p99 ms | Triton requests / executions | avg batch | LLM batch max |"
    )
    rows = [head, "|" + "---|" * 10]
    for r in results:
        f, t = r.first_chunk_ms, r.total_ms
        rows.append(
            f"| {r.concurrency} | {r.requests} | {r.errors} | {r.throughput_rps:.2f} | {r.audio_s_per_s:.2f} "
            f"| {f['p50']:.0f} / {f['p90']:.0f} / {f['p99']:.0f} | {t['p50']:.0f} / {t['p90']:.0f} / {t['p99']:.0f} "
            f"| {r.triton_requests:.0f} / {r.triton_executions:.0f} | {r.avg_batch:.2f} | {r.llm_batch_max} |"
        )
    return "\n".join(rows)


def run(
    broker: str,
    metrics_url: str | None,
    levels: Sequence[int] = DEFAULT_LEVELS,
    rounds: int = 2,
    min_requests: int = 4,
    text: str = DEFAULT_TEXT,
    model: str = "cosyvoice2",
    timeout_s: float = 120.0,
    topic_root: str = "cosyedge",
    seed: int = 1,
) -> list[LevelResult]:
    """Each level sends max(min_requests, rounds * concurrency) requests."""
    client = LoadClient(broker, "loadtest", CloudTopics(topic_root), timeout_s)
    try:
        client.request(text, seed)  # warm-up: first-use costs stay out of the numbers
        out = []
        for c in levels:
            result = run_level(client, c, max(min_requests, rounds * c), text, metrics_url, model, seed)
            log.info("concurrency %d: %s", c, json.dumps(asdict(result)))
            out.append(result)
        return out
    finally:
        client.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def local_stack(bundle: Path, max_in_flight: int, batching: DynamicBatching | None = None,
                parameters: dict[str, str] | None = None) -> Iterator[tuple[str, str]]:
    """A private mosquitto, tritonserver on `bundle` (its dynamic batching and
    model parameters set as given; the model's latest version only, the one
    unpinned requests get) and a bridge, all on loopback; yields (broker URL,
    Triton metrics URL)."""
    from cosyedge_cloud.bridge.service import BridgeService
    from cosyedge_cloud.bridge.settings import build_settings
    from cosyedge_cloud.triton.launcher import REPOSITORY, LaunchSettings, TritonServer, model_versions
    from cosyedge_cloud.wire.broker import LocalBroker

    with tempfile.TemporaryDirectory(prefix="cosyedge-loadtest-") as tmp:
        broker = LocalBroker(_free_port())
        broker.start()
        server = TritonServer(
            LaunchSettings(
                bundle=bundle,
                # one engine loaded, not one a version: at full size each holds its own graphs and lanes
                versions=(model_versions(REPOSITORY / "cosyvoice2")[-1],),
                batching=batching or DynamicBatching(),
                parameters=parameters or {},
                grpc_port=_free_port(),
                http_port=_free_port(),
                metrics_port=_free_port(),
                workdir=Path(tmp) / "triton",
                log_file=Path(tmp) / "tritonserver.log",
                ready_timeout_s=300.0,
                exit_timeout_s=2,
            )
        )
        bridge = None
        try:
            server.start()
            url = f"mqtt://127.0.0.1:{broker.port}"
            bridge = BridgeService(
                build_settings(
                    {
                        "mqtt": {"broker": url, "client_id": "loadtest-bridge"},
                        "triton": {"url": server.grpc_url, "first_chunk_timeout_s": 120.0, "chunk_timeout_s": 120.0},
                        "limits": {"max_in_flight": max_in_flight, "max_queued": 64, "drain_timeout_s": 5.0},
                        "metrics": {"port": 0},
                    }
                )
            )
            bridge.start()
            if not bridge.wait_subscribed(10):
                raise TimeoutError("the bridge did not subscribe")
            yield url, server.metrics_url
        finally:
            if bridge is not None:
                bridge.stop(drain_timeout_s=2.0)
            server.stop()
            broker.stop()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cosyedge_cloud.tools.loadtest", description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--bundle", type=Path, help="start mosquitto, tritonserver (this bundle) and a bridge")
    where.add_argument("--broker", help="an existing deployment's broker, mqtt://host:port")
    p.add_argument("--triton-metrics", help="Triton's metrics URL (with --broker), http://host:8002/metrics")
    p.add_argument("--levels", default=",".join(map(str, DEFAULT_LEVELS)), help="concurrency levels")
    p.add_argument("--rounds", type=int, default=2, help="requests per loop at each level")
    p.add_argument("--min-requests", type=int, default=4, help="at least this many requests per level")
    p.add_argument("--text", default=DEFAULT_TEXT)
    p.add_argument("--model", default="cosyvoice2")
    p.add_argument("--seed", type=int, default=1, help="sampling seed of every request (the same work each)")
    p.add_argument("--max-in-flight", type=int, default=16, help="the started bridge's cap (with --bundle)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--max-batch-size", type=int, help="the started Triton's max_batch_size (and LLM batch rows)")
    p.add_argument("--queue-delay-us", type=int, help="the started Triton's max_queue_delay_microseconds")
    p.add_argument("--gpu", action="store_true", help="the started Triton's instance on the GPU (KIND_GPU)")
    p.add_argument("--engine-backend", help="the started model's ENGINE_BACKEND (ort, ort-cuda, trt)")
    p.add_argument("--parameter", action="append", default=[], metavar="KEY=VALUE",
                   help="another of the started model's config parameters (repeatable), e.g. GRAPH_ENCODER_BATCH=true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    opts = {"levels": levels, "rounds": args.rounds, "min_requests": args.min_requests, "text": args.text,
            "model": args.model, "seed": args.seed}
    if args.bundle is not None:
        batching = DynamicBatching(args.max_batch_size, args.queue_delay_us, "KIND_GPU" if args.gpu else None)
        params = dict(_parameter(p, item) for item in args.parameter)
        if args.engine_backend:
            params["ENGINE_BACKEND"] = args.engine_backend
        with local_stack(args.bundle, args.max_in_flight, batching, params) as (broker, metrics):
            results = run(broker, metrics, **opts)  # type: ignore[arg-type]
    else:
        results = run(args.broker, args.triton_metrics, **opts)  # type: ignore[arg-type]
    print(table(results))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) | {"avg_batch": r.avg_batch} for r in results], indent=2))
    return 0 if all(r.errors == 0 for r in results) else 1


def _parameter(parser: argparse.ArgumentParser, item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        parser.error(f"--parameter takes KEY=VALUE, got {item!r}")
    return key.strip(), value.strip()


if __name__ == "__main__":
    raise SystemExit(main())
