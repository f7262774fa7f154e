"""Bridge settings, the version selector (pin, canary split) and admission
(cap, de-duplication, drain): pure logic."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from cloud_bridge.admission import Admission, Verdict
from cloud_bridge.protocol import ProtocolError
from cloud_bridge.settings import SettingsError, build_settings, load_settings
from cloud_bridge.versions import VersionSelector
from models.errors import CosyEdgeError


def test_defaults_and_overrides(tmp_path: Path) -> None:
    cfg = tmp_path / "bridge.toml"
    cfg.write_text('[mqtt]\nbroker = "mqtts://cloud:8883"\n[limits]\nmax_in_flight = 3\noverflow = "wait"\n')
    s = load_settings(cfg, triton_url="triton:9001")
    assert s.mqtt.tls and s.mqtt.port == 8883 and s.mqtt.host == "cloud"
    assert s.limits.max_in_flight == 3 and s.limits.overflow == "wait"
    assert s.triton.url == "triton:9001"
    assert load_settings(cfg, broker="mqtt://other:1999").mqtt.port == 1999


@pytest.mark.parametrize(
    ("doc", "fragment"),
    [
        ({"limits": {"overflow": "drop"}}, "limits.overflow must be one of busy, wait"),
        ({"limits": {"max_in_flight": 0}}, "limits.max_in_flight must be >= 1"),
        ({"limits": {"max_in_flight": "4"}}, "limits.max_in_flight must be an integer"),
        ({"triton": {"canary_share": 1.5}}, "triton.canary_share must be <= 1.0"),
        ({"triton": {"canary_share": 0.2}}, "needs triton.canary_version"),
        ({"triton": {"default_version": "v2"}}, "triton.default_version"),
        ({"triton": {"url": "localhost"}}, "triton.url must be host:port"),
        ({"mqtt": {"broker": "http://x"}}, "mqtt.broker"),
        ({"mqtt": {"client_id": "a/b"}}, "mqtt.client_id"),
        ({"mqtt": {"colour": "red"}}, "unknown key(s) mqtt.colour; allowed in [mqtt]: broker"),
        ({"mqttt": {}}, "unknown section(s) mqttt; allowed: mqtt, triton, limits, metrics"),
    ],
)
def test_bad_settings_name_the_field(doc: dict, fragment: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(SettingsError) as info:
        build_settings(doc)
    assert fragment in str(info.value)


def test_bad_toml_is_reported(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[mqtt\n")
    with pytest.raises(SettingsError, match="not valid TOML"):
        load_settings(cfg)


def test_pinned_version_wins_and_is_checked() -> None:
    sel = VersionSelector("1", "2", 1.0, allowed_versions=("1", "2"), seed=0)
    assert sel.choose("1").reason == "pinned"
    assert sel.choose(None).version == "2"
    with pytest.raises(ProtocolError) as info:
        sel.choose("3", "r1")
    assert info.value.code == "unknown_version" and "allowed: 1, 2" in str(info.value)


def test_canary_share_is_respected_statistically() -> None:
    n, share = 4000, 0.2
    sel = VersionSelector("1", "2", share, seed=1234)
    canary = sum(sel.choose(None).version == "2" for _ in range(n))
    # binomial sd = sqrt(n p (1-p)) ~ 25; 5 sd either side
    assert abs(canary - n * share) < 5 * (n * share * (1 - share)) ** 0.5
    again = VersionSelector("1", "2", share, seed=1234)
    assert sum(again.choose(None).version == "2" for _ in range(n)) == canary  # seeded: reproducible
    assert all(VersionSelector("1", "", 0.5).choose(None).version == "1" for _ in range(50))


def test_admission_cap_duplicates_and_drain() -> None:
    adm = Admission(capacity=2, dedup_window=2)
    assert adm.offer(("d", "a"), 1) is Verdict.ACCEPT
    assert adm.offer(("d", "a"), 7) is Verdict.DUPLICATE_RUNNING  # a redelivery while it runs
    assert adm.offer(("d", "b"), 2) is Verdict.ACCEPT
    assert adm.offer(("d", "c"), 3) is Verdict.FULL
    assert adm.offer(("e", "c"), 3) is Verdict.FULL
    assert adm.finish(("d", "a")) == [1, 7]  # both deliveries get acknowledged
    assert adm.offer(("d", "a"), 8, redelivery=True) is Verdict.DUPLICATE_DONE
    assert adm.offer(("d", "c"), 4) is Verdict.ACCEPT
    adm.finish(("d", "b"))
    adm.finish(("d", "c"))
    assert adm.offer(("d", "a"), 9, redelivery=True) is Verdict.ACCEPT  # fell out of the dedup window of 2
    adm.finish(("d", "a"))
    assert adm.offer(("d", "a"), 11) is Verdict.ACCEPT  # published anew (a retry): served again
    adm.start_draining()
    assert adm.offer(("d", "z"), 10) is Verdict.DRAINING
    assert not adm.wait_idle(0.05)
    threading.Timer(0.05, adm.finish, args=(("d", "a"),)).start()
    assert adm.wait_idle(2.0)


def test_triton_model_llm_batching_parameters() -> None:
    from cloud_bridge.triton_model import engine_kwargs
    from models.batch_policy import BatchSettings

    assert engine_kwargs({}, "ort") == {}
    assert engine_kwargs({"LLM_MAX_BATCH_SIZE": "0"}, "ort") == {}
    settings = engine_kwargs({"LLM_MAX_BATCH_SIZE": "8", "LLM_MAX_QUEUE_DELAY_MS": "2.5"}, "ort-cuda")["settings"]
    assert settings.backend == "ort-cuda"
    assert settings.batching == BatchSettings(max_batch_size=8, max_queue_delay_ms=2.5)
    with pytest.raises(CosyEdgeError, match="LLM_MAX_BATCH_SIZE must be an integer"):
        engine_kwargs({"LLM_MAX_BATCH_SIZE": "many"}, "ort")
    assert settings.flow_batching is None
    flow = engine_kwargs({"FLOW_MAX_BATCH_SIZE": "4", "FLOW_MAX_QUEUE_DELAY_MS": "1"}, "ort")["settings"]
    assert (flow.batching, flow.flow_batching) == (None, BatchSettings(max_batch_size=4, max_queue_delay_ms=1.0))
    with pytest.raises(CosyEdgeError, match="FLOW_MAX_BATCH_SIZE must be an integer"):
        engine_kwargs({"FLOW_MAX_BATCH_SIZE": "x"}, "ort")
