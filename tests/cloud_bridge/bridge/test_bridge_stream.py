"""Request -> streamed chunks -> done, through a real Mosquitto, the bridge
and a real tritonserver running the cosyvoice2 orchestrator; version pins,
the canary split, bad requests, deadlines, backpressure, drain."""

from __future__ import annotations

import threading

import numpy as np
import paho.mqtt.client as mqtt
from cosyedge_cloud.wire.protocol import CloudPrompt, CloudRequest, now_unix_ms

from tests.cloud_bridge.conftest import SINE_MODEL, V1_HZ, V2_HZ, bridge_settings
from tests.cloud_bridge.device import Device
from tests.cloud_bridge.helpers import settled_metric, triton_metric
from tests.support.broker import free_port
from tests.support.fake_synthesizer import CHUNK_SAMPLES, dominant_frequency
from tests.support.waiting import wait_for


def test_request_streams_chunks_then_done(broker, make_bridge) -> None:  # type: ignore[no-untyped-def]
    bridge = make_bridge()
    device = Device(broker.url, "kitchen")
    try:
        answer = device.ask(CloudRequest(id="r1", text="hello {chunks=4}", model_version="1", seed=1))
    finally:
        device.close()
    assert answer.error is None, answer.error
    assert [a.seq for a in answer.audio] == [0, 1, 2, 3]
    assert [a.last for a in answer.audio] == [False, False, False, True]
    assert all(a.sample_rate == 24000 and len(a.pcm16) == 2 * CHUNK_SAMPLES for a in answer.audio)
    assert abs(dominant_frequency(answer.pcm(), 24000) - V1_HZ) < 15
    assert answer.done is not None
    s = answer.done.summary
    assert s["chunks"] == 4 and s["model_version"] == "1" and s["version_reason"] == "pinned"
    assert np.isclose(s["audio_seconds"], 0.4) and s["first_chunk_ms"] <= s["total_ms"]
    assert bridge.metrics.value("cosyedge_bridge_requests_total", version="1", outcome="done") == 1
    assert bridge.metrics.value("cosyedge_bridge_first_chunk_seconds_count", version="1") == 1


def test_chunks_are_published_as_they_arrive(broker, make_bridge) -> None:  # type: ignore[no-untyped-def]
    make_bridge()
    device = Device(broker.url, "kitchen")
    try:
        answer = device.send(CloudRequest(id="slow", text="x {chunks=3} {delay_ms=400}", model_version="1"))
        assert wait_for(lambda: len(answer.audio) >= 1, 10)
        assert not answer.finished.is_set()  # the first chunk came before the synthesis ended
        assert answer.finished.wait(10)
    finally:
        device.close()
    assert answer.done is not None and len(answer.audio) == 3


def test_version_pin_and_model_version_in_chunks(broker, make_bridge) -> None:  # type: ignore[no-untyped-def]
    make_bridge()
    device = Device(broker.url, "kitchen")
    try:
        v2 = device.ask(CloudRequest(id="p2", text="hi", model_version="2"))
        v9 = device.ask(CloudRequest(id="p9", text="hi", model_version="9"))
    finally:
        device.close()
    assert v2.done is not None and v2.done.summary["model_version"] == "2"
    assert {a.model_version for a in v2.audio} == {"2"}
    assert abs(dominant_frequency(v2.pcm(), 24000) - V2_HZ) < 15  # really served by version 2
    assert v9.error is not None and v9.error.code == "unknown_version" and not v9.audio


def test_canary_share_and_per_version_metrics(broker, make_bridge) -> None:  # type: ignore[no-untyped-def]
    n, share, seed = 40, 0.3, 42
    bridge = make_bridge(
        triton={"default_version": "1", "canary_version": "2", "canary_share": share, "canary_seed": seed},
        limits={"max_in_flight": 4, "max_queued": 64},
    )
    device = Device(broker.url, "kitchen")
    try:
        answers = [device.send(CloudRequest(id=f"c{i}", text="hi {chunks=1} {delay_ms=0}")) for i in range(n)]
        assert all(a.finished.wait(30) for a in answers)
    finally:
        device.close()
    served = [a.done.summary["model_version"] for a in answers if a.done is not None]
    assert len(served) == n, [a.error for a in answers if a.error]
    # The number of canary draws among n is fixed by the seed, whatever the order of the requests:
    # one draw of Python's random.Random(canary_seed) per request (a Mersenne Twister sequence that
    # Python keeps stable), canary when below canary_share. The first 40 draws of Random(42) below
    # 0.3 are draws 1, 2, 3, 7, 9, 10, 12, 13, 16, 19, 23, 26 and 27 (counted once, in a shell).
    expected = 13
    assert served.count("2") == expected
    for a in answers:
        want = V2_HZ if a.done.summary["model_version"] == "2" else V1_HZ  # type: ignore[union-attr]
        assert abs(dominant_frequency(a.pcm(), 24000) - want) < 30
    m = bridge.metrics
    assert m.value("cosyedge_bridge_requests_total", version="2", outcome="done") == expected
    assert m.value("cosyedge_bridge_requests_total", version="1", outcome="done") == n - expected
    assert m.value("cosyedge_bridge_request_seconds_count", version="2") == expected
    assert m.value("cosyedge_bridge_version_choices_total", version="2", reason="canary") == expected


def test_errors_are_counted_per_version(broker, make_bridge) -> None:  # type: ignore[no-untyped-def]
    bridge = make_bridge()
    device = Device(broker.url, "kitchen")
    try:
        bad = [device.ask(CloudRequest(id=f"f{i}", text="x {fail_at=1}", model_version="2")) for i in range(2)]
        good = device.ask(CloudRequest(id="ok", text="x", model_version="1"))
    finally:
        device.close()
    for a in bad:
        assert a.error is not None and a.error.code == "model_error" and "fail at chunk 1" in a.error.message
        assert len(a.audio) == 1  # what came before the failure was streamed; no retry after the first chunk
    assert good.done is not None
    m = bridge.metrics
    assert m.value("cosyedge_bridge_errors_total", version="2", code="model_error") == 2
    assert m.value("cosyedge_bridge_errors_total", version="1", code="model_error") == 0
    assert m.value("cosyedge_bridge_retries_total", version="2") == 0


def test_bad_requests_get_errors_on_the_device_topic(broker, make_bridge) -> None:  # type: ignore[no-untyped-def]
    make_bridge(limits={"max_payload_bytes": 2048, "max_text_chars": 100})
    device = Device(broker.url, "kitchen")
    try:
        garbage = device.send(b"\x00\xffnot json", request_id="_")
        assert garbage.finished.wait(10)
        cases = {
            "nov": device.ask(CloudRequest(id="nov", text="hi", voice="nobody", model_version="1")),
            "mis": device.ask(CloudRequest(id="mis", text="hi", device_id="hall")),
            "long": device.ask(CloudRequest(id="long", text="x" * 101)),
            "big": device.ask(CloudRequest(id="big", text="hi", instruct_text="y" * 4000, mode="instruct")),
            "mode": device.ask(CloudRequest(id="mode", text="hi", mode="instruct")),
        }
        ok = device.ask(CloudRequest(id="after", text="still serving", model_version="1"))
    finally:
        device.close()
    assert garbage.error is not None and garbage.error.code == "bad_request" and "not UTF-8" in garbage.error.message
    codes = {k: (a.error.code if a.error else None) for k, a in cases.items()}
    assert codes == {
        "nov": "unknown_voice",
        "mis": "device_mismatch",
        "long": "too_large",
        "big": "too_large",
        "mode": "bad_request",
    }
    assert all(not a.audio for a in cases.values())
    assert ok.done is not None


def test_prompt_audio_passes_through_triton(broker, make_bridge) -> None:  # type: ignore[no-untyped-def]
    make_bridge()
    device = Device(broker.url, "kitchen")
    pitch = 300.0
    pcm = (0.3 * np.sin(2 * np.pi * pitch * np.arange(8000) / 16000)).astype(np.float32)
    try:
        answer = device.ask(
            CloudRequest(
                id="zs",
                text="clone me",
                mode="zero_shot",
                model_version="1",
                prompt=CloudPrompt(pcm, 16000, "reference words"),
            )
        )
    finally:
        device.close()
    assert answer.done is not None, answer.error
    # the sine engine sings at the prompt's pitch: the recording crossed MQTT and Triton intact
    assert abs(dominant_frequency(answer.pcm(), 24000) - pitch) < 15


def test_expired_requests_are_not_synthesized(broker, make_bridge, triton) -> None:  # type: ignore[no-untyped-def]
    make_bridge(limits={"max_in_flight": 1, "max_queued": 4})
    device = Device(broker.url, "kitchen")
    try:
        before = settled_metric(triton, "nv_inference_request_success", model=SINE_MODEL)
        stale = device.ask(CloudRequest(id="stale", text="hi", deadline_unix_ms=now_unix_ms() - 1000))
        # queued behind a 1.5 s request with 1 s of message expiry: stale by the time a worker is free
        long = device.send(CloudRequest(id="long", text="x {chunks=15} {delay_ms=100}", model_version="1"))
        queued = device.send(CloudRequest(id="queued", text="hi", model_version="1"), expiry_s=1)
        assert long.finished.wait(15) and queued.finished.wait(15)
        # Triton counts a decoupled request a moment after its last response went out
        wait_for(lambda: triton_metric(triton, "nv_inference_request_success", model=SINE_MODEL) > before, 5)
        after = settled_metric(triton, "nv_inference_request_success", model=SINE_MODEL)
    finally:
        device.close()
    assert stale.error is not None and stale.error.code == "expired" and "not synthesized" in stale.error.message
    assert queued.error is not None and queued.error.code == "expired"
    assert long.done is not None
    assert after - before == 1  # only the long one reached Triton


def test_no_first_audio_by_the_deadline_cancels(broker, make_bridge) -> None:  # type: ignore[no-untyped-def]
    bridge = make_bridge()
    device = Device(broker.url, "kitchen")
    try:
        late = device.ask(
            CloudRequest(
                id="late",
                text="x {chunks=20} {delay_ms=800}",
                model_version="1",
                deadline_unix_ms=now_unix_ms() + 400,
            )
        )
        fine = device.ask(CloudRequest(id="fine", text="x", model_version="1"))
    finally:
        device.close()
    # cancelled at the deadline: the first of its chunks (800 ms each) never came
    assert late.error is not None and late.error.code == "deadline_exceeded" and not late.audio
    assert fine.done is not None
    # The slot is released just after the answer goes out
    assert wait_for(lambda: bridge.metrics.value("cosyedge_bridge_in_flight") == 0)


def test_backpressure_busy_when_full(broker, make_bridge) -> None:  # type: ignore[no-untyped-def]
    bridge = make_bridge(limits={"max_in_flight": 1, "max_queued": 1, "overflow": "busy"})
    device = Device(broker.url, "kitchen")
    try:
        answers = [
            device.send(CloudRequest(id=f"b{i}", text="x {chunks=4} {delay_ms=150}", model_version="1"))
            for i in range(4)
        ]
        assert all(a.finished.wait(20) for a in answers)
    finally:
        device.close()
    outcome = ["done" if a.done else a.error.code for a in answers]  # type: ignore[union-attr]
    assert outcome == ["done", "done", "busy", "busy"]
    assert all(a.error.retryable for a in answers[2:])  # type: ignore[union-attr]
    assert bridge.metrics.value("cosyedge_bridge_rejected_total", reason="busy") == 2


def test_backpressure_wait_lets_the_broker_hold_requests(broker, make_bridge) -> None:  # type: ignore[no-untyped-def]
    bridge = make_bridge(limits={"max_in_flight": 1, "max_queued": 0, "overflow": "wait"})
    device = Device(broker.url, "kitchen")
    try:
        answers = [
            device.send(CloudRequest(id=f"w{i}", text="x {chunks=4} {delay_ms=100}", model_version="1"))
            for i in range(3)
        ]
        assert all(a.finished.wait(20) for a in answers)
    finally:
        device.close()
    # The bridge holds one request (capacity 1) and answers `busy` to one that reaches it while
    # full: all three done shows the broker held the others back (Receive Maximum 1) until the
    # one before was acknowledged.
    assert all(a.done is not None for a in answers), [a.error for a in answers]
    assert bridge.metrics.value("cosyedge_bridge_rejected_total", reason="busy") == 0


def test_triton_unreachable_is_retried_then_unavailable(broker, triton) -> None:  # type: ignore[no-untyped-def]
    from cosyedge_cloud.bridge.service import BridgeService

    settings = bridge_settings(
        broker, triton, triton={"url": f"127.0.0.1:{free_port()}", "retries": 2, "retry_backoff_ms": 50}
    )
    bridge = BridgeService(settings)
    bridge.start()
    assert bridge.wait_subscribed(10)
    device = Device(broker.url, "kitchen")
    try:
        answer = device.ask(CloudRequest(id="u", text="hi", model_version="1"))
    finally:
        device.close()
        bridge.stop(drain_timeout_s=1)
    assert answer.error is not None and answer.error.code == "unavailable" and answer.error.retryable
    assert bridge.metrics.value("cosyedge_bridge_retries_total", version="1") == 2


def test_mqtt_v311_device_gets_the_audio_header(broker, make_bridge) -> None:  # type: ignore[no-untyped-def]
    make_bridge()
    device = Device(broker.url, "old", protocol=mqtt.MQTTv311)
    try:
        answer = device.ask(CloudRequest(id="h", text="x {chunks=2}", model_version="1", audio_header=True))
    finally:
        device.close()
    assert [(a.seq, a.last, a.sample_rate) for a in answer.audio] == [(0, False, 24000), (1, True, 24000)]
    assert all(len(a.pcm16) == 2 * CHUNK_SAMPLES for a in answer.audio)
    assert answer.done is not None


def test_drain_finishes_in_flight_requests(broker, make_bridge) -> None:  # type: ignore[no-untyped-def]
    bridge = make_bridge()
    device = Device(broker.url, "kitchen")
    try:
        answer = device.send(CloudRequest(id="d", text="x {chunks=8} {delay_ms=100}", model_version="1"))
        assert wait_for(lambda: len(answer.audio) >= 1)
        result: list[bool] = []
        stopper = threading.Thread(target=lambda: result.append(bridge.stop(drain_timeout_s=10)))
        stopper.start()
        stopper.join(15)
        assert answer.finished.wait(5)
    finally:
        device.close()
    assert result == [True]
    assert answer.done is not None and len(answer.audio) == 8


def test_drain_timeout_cancels_with_an_error(broker, make_bridge, triton) -> None:  # type: ignore[no-untyped-def]
    bridge = make_bridge()
    device = Device(broker.url, "kitchen")
    try:
        answer = device.send(CloudRequest(id="d", text="x {chunks=60} {delay_ms=100}", model_version="1"))
        assert wait_for(lambda: len(answer.audio) >= 1)
        assert bridge.stop(drain_timeout_s=0.5) is False  # the drain timed out: the request was cut
        assert answer.finished.wait(5)
    finally:
        device.close()
    assert answer.error is not None and answer.error.code == "draining" and answer.error.retryable
    assert len(answer.audio) < 60


def test_dynamic_batching_groups_concurrent_requests(broker, make_bridge, triton) -> None:  # type: ignore[no-untyped-def]
    make_bridge(limits={"max_in_flight": 16})
    device = Device(broker.url, "kitchen")
    labels = {"model": SINE_MODEL, "version": "1"}

    try:
        req0 = settled_metric(triton, "nv_inference_request_success", **labels)
        exec0 = settled_metric(triton, "nv_inference_exec_count", **labels)
        answers = [
            device.send(CloudRequest(id=f"n{i}", text="x {chunks=2} {delay_ms=50}", model_version="1"))
            for i in range(16)
        ]
        assert all(a.finished.wait(30) for a in answers)
        requests = settled_metric(triton, "nv_inference_request_success", **labels) - req0
        executions = settled_metric(triton, "nv_inference_exec_count", **labels) - exec0
    finally:
        device.close()
    assert all(a.done is not None for a in answers)
    assert requests == 16
    assert executions < requests  # some execute() calls got batches of more than one request


def test_probe_reports_a_request(broker, make_bridge, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    import soundfile
    from cosyedge_cloud.tools.probe import main as probe_main

    make_bridge()
    out = tmp_path / "probe.wav"
    code = probe_main(
        [
            "hello {chunks=3}",
            "--broker",
            broker.url,
            "--device-id",
            "kitchen",
            "--model-version",
            "2",
            "--out",
            str(out),
            "--timeout-s",
            "30",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    assert report["chunks"] == 3 and report["done"]["model_version"] == "2"
    assert 0 < report["first_chunk_ms"] <= report["total_ms"]
    pcm, rate = soundfile.read(out, dtype="float32")
    assert rate == 24000 and pcm.size == 3 * CHUNK_SAMPLES
    assert abs(dominant_frequency(pcm, rate) - V2_HZ) < 15
    code = probe_main(["hi", "--broker", broker.url, "--model-version", "9", "--timeout-s", "30"])
    assert code == 1 and json.loads(capsys.readouterr().out)["error"]["code"] == "unknown_version"


def test_a_retry_with_the_same_id_is_served_again(broker, make_bridge) -> None:  # type: ignore[no-untyped-def]
    make_bridge()
    device = Device(broker.url, "kitchen")
    try:
        failed = device.ask(CloudRequest(id="again", text="x {chunks=1}", model_version="9"))
        device.answers.pop("again")
        # the same id published anew (not a QoS 1 redelivery): a new request, not a duplicate to drop
        retried = device.ask(CloudRequest(id="again", text="x {chunks=1}", model_version="1"))
    finally:
        device.close()
    assert failed.error is not None and failed.error.code == "unknown_version"
    assert retried.done is not None and len(retried.audio) == 1


def test_metrics_endpoint(broker, make_bridge) -> None:  # type: ignore[no-untyped-def]
    import urllib.request

    port = free_port()
    make_bridge(metrics={"port": port})
    device = Device(broker.url, "kitchen")
    try:
        assert device.ask(CloudRequest(id="m", text="x", model_version="1")).done is not None
    finally:
        device.close()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert 'cosyedge_bridge_requests_total{outcome="done",version="1"} 1.0' in text
    assert "cosyedge_bridge_first_chunk_seconds_bucket" in text and "cosyedge_bridge_in_flight 0.0" in text
