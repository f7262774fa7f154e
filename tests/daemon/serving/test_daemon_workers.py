"""`[tts] synthesis_workers` in the whole daemon over the real broker: the
cancel topic stops every running synthesis, stop answers every request,
health and metrics show the workers, and with the CosyVoice tiny bundle two
daemon requests share the engine's LLM batch."""

from __future__ import annotations

from pathlib import Path

from cosyedge_daemon.synthesizers.factory import load_local_synthesizer

from tests.daemon.conftest import DaemonFactory, make_settings
from tests.support.fake_synthesizer import FakeSynthesizer
from tests.support.memory_sink import MemorySink
from tests.support.waiting import wait_until


def test_cancel_topic_stops_every_running_synthesis(daemons: DaemonFactory) -> None:
    engine = FakeSynthesizer()
    svc = daemons.start(sink=MemorySink(speed=8.0), local=engine, fallback=None, tts={"synthesis_workers": 2})
    p = daemons.probe(svc)
    pre = svc.settings.topic_prefix
    p.publish(f"{pre}/tts/say", {"id": "h1", "text": "HOLD one", "output": "play"})
    p.publish(f"{pre}/tts/say", {"id": "h2", "text": "HOLD two", "output": "publish"})
    wait_until(lambda: "HOLD one" in engine.seen and "HOLD two" in engine.seen)
    assert engine.active == 2 and svc.pipeline.active_syntheses == 2
    assert svc.health_doc()["synthesizing"] == 2
    assert svc.metrics.registry.get_sample_value("cosyedge_tts_synthesis_workers") == 2
    wait_until(lambda: svc.metrics.registry.get_sample_value("cosyedge_tts_active_syntheses") == 2)
    p.publish(f"{pre}/tts/cancel", {"id": "h1"})
    p.publish(f"{pre}/tts/cancel", {"id": "h2"})
    assert p.wait_topic(f"{pre}/tts/error/h1", 10).json()["code"] == "cancelled"
    assert p.wait_topic(f"{pre}/tts/error/h2", 10).json()["code"] == "cancelled"
    assert engine.seen["HOLD one"].left.wait(5) and engine.seen["HOLD two"].left.wait(5)
    assert engine.seen["HOLD one"].cancelled and engine.seen["HOLD two"].cancelled
    p.publish(f"{pre}/tts/say", {"id": "ok", "text": "after", "output": "play"})
    assert p.wait_topic(f"{pre}/tts/done/ok", 10).json()["reason"] == "completed"
    assert svc.liveness() == {"synthesis-1": True, "synthesis-2": True, "playback": True, "intake": True}


def test_stop_answers_running_and_queued_requests(daemons: DaemonFactory) -> None:
    engine = FakeSynthesizer()
    svc = daemons.start(local=engine, fallback=None, tts={"synthesis_workers": 2})
    p = daemons.probe(svc)
    pre = svc.settings.topic_prefix
    ids = ["r1", "r2", "q1", "q2"]
    for rid in ids:
        p.publish(f"{pre}/tts/say", {"id": rid, "text": f"HOLD {rid}", "output": "publish"})
    wait_until(lambda: svc.scheduler.depth == 2 and engine.active == 2)
    svc.stop(timeout_s=0.3)
    codes = {rid: p.wait_topic(f"{pre}/tts/error/{rid}", 10).json()["code"] for rid in ids}
    assert codes == dict.fromkeys(ids, "shutting_down")
    assert set(engine.seen) == {"HOLD r1", "HOLD r2"}  # the queued two never reached the engine
    assert all(s.cancelled for s in engine.seen.values())
    assert svc.pipeline.workers_alive(stall_s=60.0) == {"synthesis-1": False, "synthesis-2": False}


def test_two_daemon_requests_share_the_tiny_engines_llm_batch(daemons: DaemonFactory, tiny_bundle: Path) -> None:
    # A long join delay: the first request waits for the second, so the two must decode as one batch.
    settings = make_settings(daemons.broker.url, tts={"llm_max_batch_size": 2, "llm_max_queue_delay_ms": 5000})
    assert settings.tts.synthesis_worker_count == 2  # "auto" with batching
    engine = load_local_synthesizer(settings, bundle=str(tiny_bundle))
    svc = daemons.start(settings=settings, local=engine, fallback=None)
    p = daemons.probe(svc)
    pre = svc.settings.topic_prefix
    p.publish(f"{pre}/tts/say", {"id": "b1", "text": "Hello from the first request.", "output": "publish"})
    p.publish(f"{pre}/tts/say", {"id": "b2", "text": "And hello from the second.", "output": "publish"})
    for rid in ("b1", "b2"):
        done = p.wait_topic(f"{pre}/tts/done/{rid}", 120).json()
        assert (done["route"], done["reason"]) == ("local", "completed") and done["audio_seconds"] > 0
    stats = getattr(engine, "batcher").stats  # noqa: B009 - CosyVoiceSynthesizer's, not the Synthesizer protocol's
    assert stats.peak_batch == 2 and stats.shared_steps > 0


def test_requests_beyond_the_engines_streams_wait_in_the_queue_where_the_router_sees_them(
        daemons: DaemonFactory) -> None:
    """An engine that serves one stream at once (as the GPU flow's seats say) under two workers: the
    second local request waits in the daemon's queue, not inside the engine, so the queue-depth rule
    sends the third to the cloud, which serves it while the local engine is still busy."""
    local, cloud = FakeSynthesizer(streams=1), FakeSynthesizer()
    svc = daemons.start(local=local, fallback=None, tts={"synthesis_workers": 2},
                        routing={"cloud_queue_depth": 1})
    svc.synthesizers.slots["cloud"].swap(cloud)
    assert svc.health_doc()["local_at_once"] == 1
    p = daemons.probe(svc)
    pre = svc.settings.topic_prefix
    p.publish(f"{pre}/tts/say", {"id": "h1", "text": "HOLD one", "output": "publish"})
    wait_until(lambda: local.active == 1)
    p.publish(f"{pre}/tts/say", {"id": "h2", "text": "HOLD two", "output": "publish"})
    wait_until(lambda: svc.scheduler.depth == 1)  # held at the engine's bound, a worker free
    p.publish(f"{pre}/tts/say", {"id": "c3", "text": "third", "output": "publish"})
    done = p.wait_topic(f"{pre}/tts/done/c3", 10).json()
    assert done["route"] == "cloud" and done["route_rule"] == "queue_depth", done
    assert cloud.started == ["third"] and local.active == 1 and "HOLD two" not in local.seen
    local.release.set()
    for rid in ("h1", "h2"):
        assert p.wait_topic(f"{pre}/tts/done/{rid}", 10).json()["route"] == "local"
    assert local.max_active == 1


def test_the_local_bound_follows_the_engine(daemons: DaemonFactory) -> None:
    svc = daemons.start(local=FakeSynthesizer(streams=3), fallback=None, tts={"synthesis_workers": 2})
    assert svc.scheduler.local_limit == 3  # above the workers: binds nothing, stated all the same
    svc.set_synthesizers(FakeSynthesizer(), None)
    assert svc.scheduler.local_limit is None and svc.health_doc()["local_at_once"] is None
