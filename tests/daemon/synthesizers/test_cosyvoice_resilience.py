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

import signal
import time
from pathlib import Path

import pytest
from cosyedge_models.synthesis.synthesizer import load_synthesizer

from tests.daemon.conftest import DaemonFactory, SynthesizerFactory
from tests.daemon.service.test_process import Daemon
from tests.support.broker import Broker
from tests.support.figures import record
from tests.support.mqtt_recorder import Recorder

RESTARTS = 10
TEXT = "Hello from the tiny model, one two three four five six."
# Seeded: unseeded, the random-weight tiny model's sampling degenerates now and then (EOS drawn 100
# times before the minimum length), the request fails over to the fallback engine and its answer is
# no longer the local one this test counts (seen once in a full CI-size run).
SEED = 3


@pytest.fixture()
def engine_factory(tiny_bundle: Path) -> SynthesizerFactory:
    return lambda: load_synthesizer(tiny_bundle)


def session_client(broker: Broker, topics: list[str]) -> Recorder:
    """A subscriber with a persistent session (expiry 300 s): the broker keeps
    what arrives for it while it is away, so a restart loses nothing for it."""
    return Recorder(broker.url, topics, session_expiry_s=300, name="sess")


def test_broker_restarted_10_times_mid_request(daemons: DaemonFactory) -> None:
    svc = daemons.start()
    pre = svc.settings.topic_prefix
    sub = session_client(daemons.broker, [f"{pre}/tts/#", f"{pre}/status"])
    outcomes, reconnect_s = [], []
    try:
        for n in range(RESTARTS):
            rid = f"br{n}"
            assert sub.wait(sub.client.is_connected, 15)
            sub.publish(f"{pre}/tts/say", {"id": rid, "text": TEXT, "output": "publish", "seed": SEED})
            assert sub.wait(lambda rid=rid: sub.on(f"{pre}/tts/audio/{rid}"), 60), f"{rid}: no audio"
            count = svc.conn.connect_count
            t0 = time.monotonic()
            daemons.broker.restart(down_s=0.3)
            assert sub.wait(lambda c=count: svc.conn.connect_count > c and svc.conn.connected.is_set(), 15)
            reconnect_s.append(round(time.monotonic() - t0, 2))
            assert sub.wait(lambda rid=rid: sub.on(f"{pre}/tts/done/{rid}") or sub.on(f"{pre}/tts/error/{rid}"),
                            90), (f"{rid}: no answer; daemon side: {svc.scheduler.check_duplicate(rid)}; "
                                  f"received: {[m.topic for m in sub.messages][-8:]}")
        # a last request answered: a late or doubled answer of the restarts would have come before it
        sub.publish(f"{pre}/tts/say", {"id": "last", "text": TEXT, "output": "publish", "seed": SEED})
        assert sub.wait(lambda: bool(sub.on(f"{pre}/tts/done/last")), 90)
        for n in range(RESTARTS):
            done, errors = sub.on(f"{pre}/tts/done/br{n}"), sub.on(f"{pre}/tts/error/br{n}")
            outcomes.append({"done": len(done), "errors": len(errors),
                             **({k: done[0].json()[k] for k in ("reason", "route")} if done else {})})
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
        sub = session_client(broker, [f"{d.prefix}/tts/#", f"{d.prefix}/status"])
        ids = [f"load{n}" for n in range(8)]
        for rid in ids:
            sub.publish(f"{d.prefix}/tts/say", {"id": rid, "text": TEXT, "output": "publish", "seed": SEED})
        assert sub.wait(lambda: sub.on(f"{d.prefix}/tts/done/load0"), 120)
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        code = d.proc.wait(20)
        took = time.monotonic() - t0
        # the daemon's last message is its offline status: every answer it sent came before
        assert sub.wait(lambda: any(m.payload == b"offline" for m in sub.on(f"{d.prefix}/status")), 10)
        answers = {}
        for rid in ids:
            done, err = sub.on(f"{d.prefix}/tts/done/{rid}"), sub.on(f"{d.prefix}/tts/error/{rid}")
            assert len(done) + len(err) == 1, f"{rid}: {len(done)} done, {len(err)} errors"
            answers[rid] = "done" if done else err[0].json()["code"]
        statuses = [m.payload for m in sub.on(f"{d.prefix}/status")]
    except (AssertionError, TimeoutError) as exc:
        raise AssertionError(f"{exc}\ndaemon log:\n{d.output()[-4000:]}") from exc
    finally:
        if sub is not None:
            sub.close()
        d.close()
    record("cosyvoice-sigterm", {"exit_code": code, "drain_s": round(took, 2), "answers": answers})
    assert code == 0  # bounded by proc.wait(20); "shutting_down" answers show the drain was cut
    assert set(answers.values()) == {"done", "shutting_down"}
    assert statuses[-1] == b"offline"
