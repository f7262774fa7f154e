"""End to end on loopback with real processes: Mosquitto, the daemon's
Service (cloud engine on, the CosyVoice tiny bundle as its local engine),
the cloud bridge (in this process, or `cosyedge bridge` as a process that
is killed) and tritonserver with the tiny bundle (`cosyvoice2`) and the
`sine` fixture model (its timing set by the text, so a test can kill the
cloud at a known point of a request).

The link test puts the daemon behind its own Mosquitto, bridged to the
cloud broker (password, ACL) with the template of systemd/mosquitto/. That a
device cannot subscribe to another device's responses is tested in
test_acl_and_links.py (the cloud broker with the ACL template)."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from cosyedge_cloud.triton.launcher import TritonServer
from cosyedge_models.synthesis.api import Synthesizer

from tests.cloud_bridge.bridge.test_bridge_process import BridgeProcess
from tests.cloud_bridge.conftest import SINE_MODEL, V1_HZ, V2_HZ, device_broker_conf
from tests.cloud_bridge.edge import Edge, load_local
from tests.support.broker import Broker, running_broker
from tests.support.fake_synthesizer import CHUNK_SAMPLES
from tests.support.waiting import wait_for

PRODUCT = {"model": "cosyvoice2", "first_chunk_timeout_s": 120.0, "chunk_timeout_s": 120.0}
LONG = " ".join(f"This is sentence number {n} of a long announcement." for n in range(1, 5))


@pytest.fixture()
def local_engine(tiny_bundle: Path) -> Synthesizer:
    return load_local(tiny_bundle)  # the daemon closes it when it stops


@pytest.fixture()
def edges(broker: Broker) -> Iterator[Callable[..., Edge]]:
    made: list[Edge] = []

    def make(local: Synthesizer | None, **sections: dict) -> Edge:  # type: ignore[type-arg]
        edge = Edge(broker.url, local, **sections)
        made.append(edge)
        return edge

    yield make
    for edge in made:
        edge.close()


@pytest.fixture()
def bridge_process(broker: Broker, triton: TritonServer, tmp_path: Path) -> Iterator[Callable[..., BridgeProcess]]:
    """`cosyedge bridge` on the sine model; a client id is a persistent session
    (in a share group of its own: Mosquitto also hands shared messages to a
    member whose process is dead)."""
    started: list[BridgeProcess] = []

    def start(log_name: str, client_id: str = "bridge-e2e") -> BridgeProcess:
        config = tmp_path / f"{client_id}.toml"
        config.write_text(
            f'[mqtt]\nbroker = "{broker.url}"\nclient_id = "{client_id}"\nshare_group = "{client_id}"\n'
            f'[triton]\nurl = "{triton.grpc_url}"\nmodel = "{SINE_MODEL}"\nfirst_chunk_timeout_s = 60.0\n'
            f"chunk_timeout_s = 60.0\n[limits]\ndrain_timeout_s = 5.0\n[metrics]\nport = 0\n"
        )
        process = BridgeProcess(config, tmp_path / log_name)
        process.start()
        started.append(process)
        return process

    yield start
    for process in started:
        process.close()


def test_long_text_goes_to_the_cloud_and_is_spoken(make_bridge, edges, local_engine) -> None:  # type: ignore[no-untyped-def]
    bridge = make_bridge(triton=PRODUCT)
    edge = edges(local_engine, routing={"cloud_min_chars": 120})
    assert len(LONG) >= 120
    health = edge.service.health_doc()
    assert health["cloud"] == {"enabled": True, "link": "unknown"}  # a direct connection: no link topic
    assert health["engines"]["cloud"]["state"] == "ready"
    edge.say("long", LONG, output="both", seed=7)
    done_msg = edge.answer("long", 180)
    assert done_msg.topic.endswith("/done/long"), done_msg.payload
    done = done_msg.json()
    assert (done["route"], done["route_rule"], done["engine"]) == ("cloud", "text_length", "cloud")
    assert "characters" in done["route_reason"]
    pcm = edge.audio("long")
    assert pcm.size > 0 and np.abs(pcm).max() > 0 and done["chunks"] > 0
    assert abs(pcm.size / 24000 - done["audio_seconds"]) < 0.01
    assert edge.played_samples() >= pcm.size - 2400  # spoken (the sink rate is the bundle's)
    assert len(edge.cloud_requests()) == 1
    assert bridge.metrics.value("cosyedge_bridge_requests_total", version="2", outcome="done") == 1
    # a short text stays on the device
    edge.say("short", "Hi there.", output="publish")
    short = edge.answer("short", 120).json()
    assert (short["route"], short["route_rule"]) == ("local", "default")
    assert len(edge.cloud_requests()) == 1
    reg = edge.service.metrics.registry

    def counted(route: str, rule: str) -> bool:  # counted just after `done` went out
        return reg.get_sample_value("cosyedge_tts_routes_total", {"route": route, "rule": rule}) == 1

    assert wait_for(lambda: counted("cloud", "text_length") and counted("local", "default"), 5)


def test_cloud_killed_mid_request_falls_back_or_errs_within_the_deadline(  # type: ignore[no-untyped-def]
    bridge_process, edges, local_engine
) -> None:
    edge = edges(
        local_engine,
        routing={"cloud_min_chars": 30},  # short texts: the local engine (about real time here) is quick
        cloud={"first_chunk_timeout_s": 3.0, "chunk_timeout_s": 1.5},
    )
    deadline_ms = 20_000
    # killed before its first chunk: the local engine speaks it (Triton ends its
    # stream, which nobody reads any more, before the next request)
    bridge = bridge_process("bridge-1.log")
    sent = edge.say("before", "Hello cloud. {chunks=1}{delay_ms=2500}", output="publish", deadline_ms=deadline_ms)
    assert wait_for(lambda: edge.cloud_requests(), 10)
    bridge.signal(signal.SIGKILL)
    bridge.wait(10)
    msg = edge.answer("before", deadline_ms / 1000)
    took_s = msg.at - sent
    done = msg.json()
    assert msg.topic.endswith("/done/before"), done
    assert (done["route"], done["route_rule"]) == ("local", "cloud_failed") and "no audio" in done["route_reason"]
    assert done["chunks"] > 0 and took_s < deadline_ms / 1000
    assert edge.audio("before").size > 0
    # killed after audio went out: no second voice mid-sentence, an error soon after the stream stalls
    bridge = bridge_process("bridge-2.log", "bridge-e2e-2")  # not the dead one's session
    sent = edge.say("midway", "Go on and on. {chunks=40}{delay_ms=200}", output="publish", deadline_ms=deadline_ms)
    assert wait_for(lambda: edge.audio("midway").size >= 2 * CHUNK_SAMPLES, 20)
    bridge.signal(signal.SIGKILL)
    killed = time.monotonic()
    bridge.wait(10)
    msg = edge.answer("midway", deadline_ms / 1000)
    err = msg.json()
    assert msg.topic.endswith("/error/midway"), err
    assert err["code"] == "engine_error" and "stalled" in err["message"]
    assert msg.at - killed < 1.5 + 1.0 and msg.at - sent < deadline_ms / 1000
    assert 2 * CHUNK_SAMPLES <= edge.audio("midway").size < 40 * CHUNK_SAMPLES
    # the cloud counts failures; the daemon keeps serving
    assert edge.service.synthesizers.slots["cloud"].failures == 2
    edge.say("after", "Still here.", output="publish")
    assert edge.answer("after", 60).json()["route"] == "local"


def test_bridge_restarted_mid_request_loses_nothing(bridge_process, edges, local_engine) -> None:  # type: ignore[no-untyped-def]
    edge = edges(local_engine, cloud={"first_chunk_timeout_s": 30.0, "chunk_timeout_s": 30.0})
    bridge = bridge_process("bridge-1.log")
    chunks = 12
    edge.say("kept", f"Keep going. {{chunks={chunks}}}{{delay_ms=250}}", output="publish", route="cloud")
    assert wait_for(lambda: edge.audio("kept").size >= 3 * CHUNK_SAMPLES, 30)
    bridge.signal(signal.SIGKILL)
    bridge.wait(10)
    bridge_process("bridge-2.log")  # the same session: the unanswered request comes again
    msg = edge.answer("kept", 60)
    done = msg.json()
    assert msg.topic.endswith("/done/kept"), done
    assert (done["route"], done["chunks"]) == ("cloud", chunks)
    pcm = edge.audio("kept").astype(np.float32) / 32767.0
    assert pcm.size == chunks * CHUNK_SAMPLES  # nothing twice, nothing missing
    t = np.arange(pcm.size) / 24000.0
    # the resynthesized stream continues the same tone without a jump
    err = min(float(np.abs(pcm - 0.5 * np.sin(2 * np.pi * hz * t)).max()) for hz in (V1_HZ, V2_HZ))
    assert err < 1e-3
    assert len(edge.cloud_requests()) == 1  # the device sent it once; the broker redelivered it


def test_link_state_routes_without_waiting_for_a_timeout(  # type: ignore[no-untyped-def]
    cloud_broker, cloud_bridge, local_engine
) -> None:
    with running_broker(extra_conf=device_broker_conf(cloud_broker, "devA")) as device_broker:
        edge = Edge(
            device_broker.url,
            local_engine,
            device_id="devA",
            routing={"cloud_min_chars": 20},
            cloud={"first_chunk_timeout_s": 30.0},
        )
        try:
            cloud = edge.service.cloud
            assert cloud is not None
            assert wait_for(lambda: cloud.link_up is True, 10), "the device broker's bridge did not come up"
            edge.say("up", "Over the link we go. {chunks=2}", output="publish")
            up = edge.answer("up", 30).json()
            assert (up["route"], up["route_rule"], up["chunks"]) == ("cloud", "text_length", 2), up
            # the cloud broker goes away: the device broker says so on the link topic ("0")
            cloud_broker.stop()
            assert wait_for(lambda: cloud.link_up is False, 10)
            health = edge.service.health_doc()
            assert health["cloud"]["link"] == "down" and health["engines"]["cloud"]["state"] == "unreachable"
            sent = edge.say("down", "Hello link, goodbye.", output="publish")
            msg = edge.answer("down", 30)
            down = msg.json()
            assert (down["route"], down["route_rule"]) == ("local", "default"), down
            assert msg.at - sent < 15  # no wait for the 30 s first-chunk timeout
            assert len(edge.cloud_requests()) == 1
            edge.say("must", "Cloud only.", output="publish", route="cloud")  # refused at once
            msg = edge.answer("must", 5)
            assert msg.topic.endswith("/error/must") and msg.json()["code"] == "cloud_unavailable"
            # and back
            cloud_broker.start()
            assert wait_for(lambda: cloud.link_up is True, 15)
        finally:
            edge.close()
