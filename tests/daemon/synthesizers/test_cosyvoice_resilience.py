"""Resilience on the product's engine (CosyVoice on the tiny bundle, with its
batcher and overlap threads), each with an exact expected outcome:
- the broker restarted 10 times, each time while a request streams: every
  request ends with exactly one `done` (reason completed, route local), the
  daemon reconnects after each restart (11 connections in all) and is online;
- SIGTERM to the daemon process with 8 requests queued: exit status 0 within
  the stop timeout, every request answered exactly once (done for those
  that finished, `shutting_down` for the rest, at least one of each) and
  `offline` retained.
The cloud killed mid-request on the same engine is
tests/cloud_bridge/bridge/test_e2e_routing.py::test_cloud_killed_mid_request_falls_back_or_errs_within_the_deadline
(killed before its first chunk: done with route local, rule cloud_failed; after audio: engine_error)."""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from cosyedge_models.synthesis.synthesizer import load_synthesizer
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from tests.daemon.conftest import DaemonFactory, SynthesizerFactory
from tests.daemon.service.test_process import Daemon
from tests.support.broker import Broker
from tests.support.figures import record

RESTARTS = 10
TEXT = "Hello from the tiny model, one two three four five six."


@pytest.fixture()
def engine_factory(tiny_bundle: Path) -> SynthesizerFactory:
    return lambda: load_synthesizer(tiny_bundle)


class SessionClient:
    """A subscriber with a persistent session (expiry 300 s): the broker keeps
    what arrives for it while it is away, so a restart loses nothing for it."""

    def __init__(self, broker: Broker, topics: list[str]) -> None:
        self.messages: list[tuple[str, bytes]] = []
        self.cond = threading.Condition()
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"sess-{uuid.uuid4().hex[:6]}",
                             protocol=mqtt.MQTTv5)
        subscribed = threading.Event()
        self.c.on_connect = lambda cl, _u, flags, _rc, _p: (
            None if flags.session_present else cl.subscribe([(t, 1) for t in topics]))
        self.c.on_subscribe = lambda *_a: subscribed.set()
        self.c.on_message = self._on
        self.c.reconnect_delay_set(0.1, 1)
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 300
        self.c.connect("127.0.0.1", broker.port, clean_start=False, properties=props)
        self.c.loop_start()
        assert subscribed.wait(10)

    def _on(self, _c: object, _u: object, m: mqtt.MQTTMessage) -> None:
        with self.cond:
            self.messages.append((m.topic, bytes(m.payload)))
            self.cond.notify_all()

    def on(self, topic: str) -> list[bytes]:
        with self.cond:
            return [p for t, p in self.messages if t == topic]

    def wait(self, pred, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
        with self.cond:
            return self.cond.wait_for(pred, timeout_s)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def test_broker_restarted_10_times_mid_request(daemons: DaemonFactory) -> None:
    svc = daemons.start()
    pre = svc.settings.topic_prefix
    sub = SessionClient(daemons.broker, [f"{pre}/tts/#", f"{pre}/status"])
    outcomes, reconnect_s = [], []
    try:
        for n in range(RESTARTS):
            rid = f"br{n}"
            assert sub.wait(sub.c.is_connected, 15)
            sub.c.publish(f"{pre}/tts/say", json.dumps({"id": rid, "text": TEXT, "output": "publish"}), qos=1)
            assert sub.wait(lambda rid=rid: sub.on(f"{pre}/tts/audio/{rid}"), 60), f"{rid}: no audio"
            count = svc.conn.connect_count
            t0 = time.monotonic()
            daemons.broker.restart(down_s=0.3)
            assert sub.wait(lambda c=count: svc.conn.connect_count > c and svc.conn.connected.is_set(), 15)
            reconnect_s.append(round(time.monotonic() - t0, 2))
            assert sub.wait(lambda rid=rid: sub.on(f"{pre}/tts/done/{rid}") or sub.on(f"{pre}/tts/error/{rid}"),
                            90), (f"{rid}: no answer; daemon side: {svc.scheduler.check_duplicate(rid)}; "
                                  f"received: {[t for t, _ in sub.messages][-8:]}")
        time.sleep(1.0)
        for n in range(RESTARTS):
            done, errors = sub.on(f"{pre}/tts/done/br{n}"), sub.on(f"{pre}/tts/error/br{n}")
            outcomes.append({"done": len(done), "errors": len(errors),
                             **({k: json.loads(done[0])[k] for k in ("reason", "route")} if done else {})})
    finally:
        sub.close()
    record("cosyvoice-broker-restarts", {"restarts": RESTARTS, "outcomes": outcomes,
                                         "reconnect_s": reconnect_s, "connections": svc.conn.connect_count})
    assert outcomes == [{"done": 1, "errors": 0, "reason": "completed", "route": "local"}] * RESTARTS
    assert svc.conn.connect_count == RESTARTS + 1 and svc.conn.connected.is_set()
    assert svc.health_doc()["state"] == "ready"


class CosyDaemon(Daemon):
    bundle = ""

    def write(self, mqtt_extra: str, rest: str) -> None:
        self.config.write_text(
            f'device_id = "{self.device}"\n[mqtt]\nbroker = "{self.broker_url}"\n{mqtt_extra}'
            f'[tts]\nengine = "cosyvoice"\nbundle = "{self.bundle}"\n[audio]\ndevice = "none"\n' + rest)


def test_sigterm_under_load_on_cosyvoice(tmp_path: Path, broker: Broker, tiny_bundle: Path) -> None:
    CosyDaemon.bundle = str(tiny_bundle)
    d = CosyDaemon(tmp_path, broker, "[health]\nmetrics_port = 0\nstop_timeout_s = 3.0\n")
    sub = None
    try:
        d.wait_note("READY=1", 120)
        sub = SessionClient(broker, [f"{d.prefix}/tts/#", f"{d.prefix}/status"])
        ids = [f"load{n}" for n in range(8)]
        for rid in ids:
            sub.c.publish(f"{d.prefix}/tts/say", json.dumps({"id": rid, "text": TEXT, "output": "publish"}), qos=1)
        assert sub.wait(lambda: sub.on(f"{d.prefix}/tts/done/load0"), 120)
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        code = d.proc.wait(20)
        took = time.monotonic() - t0
        time.sleep(0.5)
        answers = {}
        for rid in ids:
            done, err = sub.on(f"{d.prefix}/tts/done/{rid}"), sub.on(f"{d.prefix}/tts/error/{rid}")
            assert len(done) + len(err) == 1, f"{rid}: {len(done)} done, {len(err)} errors"
            answers[rid] = "done" if done else json.loads(err[0])["code"]
        statuses = sub.on(f"{d.prefix}/status")
    except (AssertionError, TimeoutError) as exc:
        raise AssertionError(f"{exc}\ndaemon log:\n{d.output()[-4000:]}") from exc
    finally:
        if sub is not None:
            sub.close()
        d.close()
    record("cosyvoice-sigterm", {"exit_code": code, "drain_s": round(took, 2), "answers": answers})
    assert code == 0 and took < 3.0 + 5.0
    assert set(answers.values()) == {"done", "shutting_down"}
    assert statuses[-1] == b"offline"
