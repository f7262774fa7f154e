"""Bridge settings, the version selector (pin, canary split) and admission
(cap, de-duplication, drain): pure logic."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from cosyedge_cloud.bridge.admission import Admission, Verdict
from cosyedge_cloud.bridge.settings import SettingsError, build_settings, load_settings, reference_markdown
from cosyedge_cloud.bridge.versions import VersionSelector
from cosyedge_cloud.wire.protocol import ProtocolError
from cosyedge_models.errors import CosyEdgeError


def test_defaults_and_overrides(tmp_path: Path) -> None:
    cfg = tmp_path / "bridge.toml"
    cfg.write_text('[mqtt]\nbroker = "mqtts://cloud:8883"\n[limits]\nmax_in_flight = 3\noverflow = "wait"\n')
    s = load_settings(cfg, triton_url="triton:9001")
    assert s.mqtt.address.tls and s.mqtt.address.port == 8883 and s.mqtt.address.host == "cloud"
    assert s.limits.max_in_flight == 3 and s.limits.overflow == "wait"
    assert s.triton.url == "triton:9001"
    assert load_settings(cfg, broker="mqtt://other:1999").mqtt.address.port == 1999


@pytest.mark.parametrize(
    ("doc", "fragment"),
    [
        ({"limits": {"overflow": "drop"}}, '[limits] overflow = "drop": allowed values: "busy", "wait"'),
        ({"limits": {"max_in_flight": 0}}, "[limits] max_in_flight = 0: must be between 1 and 1024"),
        ({"limits": {"max_in_flight": "4"}}, '[limits] max_in_flight: expected an integer, got "4"'),
        ({"limits": {"dedup_window": 5, "dedupe_max_ids": 5}}, "dedup_window is the old name of dedupe_max_ids"),
        ({"triton": {"canary_share": 1.5}}, "[triton] canary_share = 1.5: must be between 0.0 and 1.0"),
        ({"triton": {"canary_share": 0.2}}, "canary_share > 0 needs canary_version"),
        ({"triton": {"default_version": "v2"}}, '[triton] default_version = "v2": allowed values: empty or a'),
        ({"triton": {"allowed_versions": ["1", "x"]}}, "[triton] allowed_versions"),
        ({"triton": {"url": "localhost"}}, '[triton] url = "localhost": allowed values: host:port'),
        ({"mqtt": {"broker": "http://x"}}, '[mqtt] broker = "http://x": allowed values: mqtt://host[:port]'),
        ({"mqtt": {"broker": "mqtt://h:70000"}}, '[mqtt] broker = "mqtt://h:70000": allowed values'),
        ({"mqtt": {"client_id": "a/b"}}, '[mqtt] client_id = "a/b": allowed values: a non-empty string'),
        ({"mqtt": {"password": "p", "password_file": "/f"}}, "password and password_file: set one, not both"),
        ({"mqtt": {"colour": "red"}}, "[mqtt] unknown key colour; known keys: broker"),
        ({"mqttt": {}}, "unknown section(s) mqttt; allowed: mqtt, triton, limits, metrics"),
    ],
)
def test_bad_settings_name_the_field(doc: dict, fragment: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(SettingsError) as info:
        build_settings(doc)
    assert fragment in str(info.value)


def test_old_key_name_is_read_and_docs_are_current() -> None:
    """`dedup_window` (the old name) still sets `dedupe_max_ids`; the reference in
    docs/ is what the schema generates; the replica example loads."""
    assert build_settings({"limits": {"dedup_window": 7}}).limits.dedupe_max_ids == 7
    root = Path(__file__).resolve().parents[3]
    text = (root / "docs" / "bridge-configuration.md").read_text()
    assert text == reference_markdown(), \
        "regenerate: python -m cosyedge_cloud.bridge.settings > docs/bridge-configuration.md"
    for section in ("mqtt", "triton", "limits", "metrics"):
        assert f"### `[{section}]`" in text
    assert "| `dedupe_max_ids` | `4096` |" in text
    replica = load_settings(root / "systemd" / "cloud" / "bridge-1.toml")
    assert replica.triton.canary_version == "2" and replica.limits.max_in_flight == 16


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
    adm = Admission(capacity=2, dedupe_max_ids=2)
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


def test_triton_model_graph_batching_follows_the_bundles_batched_graphs(static_flow_bundle: Path,
                                                                        tiny_bundle: Path) -> None:
    from cosyedge_cloud.triton.orchestrator import engine_kwargs

    params = {"LLM_MAX_BATCH_SIZE": "8"}
    assert engine_kwargs(params, "ort-cuda", static_flow_bundle)["settings"].graph_flow_batch is True
    assert engine_kwargs(params, "ort-cuda", tiny_bundle)["settings"].graph_flow_batch is False
    # the captured graphs' two options: off unless asked for, as in the daemon's [tts]
    plain = engine_kwargs(params, "ort-cuda", static_flow_bundle)["settings"]
    assert (plain.graph_encoder_batch, plain.llm_captured_prefill, plain.graph_vocoder_batch) == (False, False, False)
    both = engine_kwargs({**params, "GRAPH_ENCODER_BATCH": "true", "LLM_CAPTURED_PREFILL": " True ",
                          "GRAPH_VOCODER_BATCH": "true"}, "ort-cuda", static_flow_bundle)["settings"]
    assert (both.graph_encoder_batch, both.llm_captured_prefill, both.graph_vocoder_batch) == (True, True, True)
    with pytest.raises(CosyEdgeError, match="GRAPH_ENCODER_BATCH must be one of true, false, got 'on'"):
        engine_kwargs({**params, "GRAPH_ENCODER_BATCH": "on"}, "ort-cuda", static_flow_bundle)


def test_triton_model_llm_batching_parameters() -> None:
    from cosyedge_cloud.triton.orchestrator import engine_kwargs
    from cosyedge_models.batching.policy import BatchSettings

    assert engine_kwargs({}, "ort") == {}
    assert engine_kwargs({"LLM_MAX_BATCH_SIZE": "0"}, "ort") == {}
    settings = engine_kwargs({"LLM_MAX_BATCH_SIZE": "8", "LLM_MAX_QUEUE_DELAY_MS": "2.5"}, "ort-cuda")["settings"]
    assert settings.backend == "ort-cuda"
    assert settings.batching == BatchSettings(max_batch_size=8, max_queue_delay_ms=2.5)
    # GRAPH_BATCHING auto: the batch on the captured graphs on ort-cuda (the estimator windows
    # only where the bundle has their batched graphs), the dynamic batchers elsewhere
    assert (settings.graph_batching, settings.graph_flow_batch) == (True, False)
    assert engine_kwargs({"LLM_MAX_BATCH_SIZE": "8"}, "ort")["settings"].graph_batching is False
    forced = engine_kwargs({"LLM_MAX_BATCH_SIZE": "4", "FLOW_MAX_BATCH_SIZE": "4", "GRAPH_BATCHING": "true"},
                           "ort")["settings"]
    assert (forced.graph_batching, forced.graph_flow_batch, forced.flow_batching) == (True, True, None)
    off = engine_kwargs({"LLM_MAX_BATCH_SIZE": "4", "GRAPH_BATCHING": "false"}, "ort-cuda")["settings"]
    assert off.graph_batching is False
    with pytest.raises(CosyEdgeError, match="GRAPH_BATCHING must be one of auto, true, false, got 'yes please'"):
        engine_kwargs({"LLM_MAX_BATCH_SIZE": "4", "GRAPH_BATCHING": "yes please"}, "ort")
    with pytest.raises(CosyEdgeError, match="LLM_MAX_BATCH_SIZE must be an integer"):
        engine_kwargs({"LLM_MAX_BATCH_SIZE": "many"}, "ort")
    assert settings.flow_batching is None
    flow = engine_kwargs({"FLOW_MAX_BATCH_SIZE": "4", "FLOW_MAX_QUEUE_DELAY_MS": "1"}, "ort")["settings"]
    assert (flow.batching, flow.flow_batching) == (None, BatchSettings(max_batch_size=4, max_queue_delay_ms=1.0))
    with pytest.raises(CosyEdgeError, match="FLOW_MAX_BATCH_SIZE must be an integer"):
        engine_kwargs({"FLOW_MAX_BATCH_SIZE": "x"}, "ort")


def test_triton_model_overflow_slots_parameter(static_flow_bundle: Path) -> None:
    """GRAPH_FLOW_OVERFLOW_SLOTS: the single-stream slots beside the lanes (graph_flow_overflow_slots)."""
    from cosyedge_cloud.triton.orchestrator import engine_kwargs
    from cosyedge_models.backends.fixed_shapes import OVERFLOW_FLOW_SLOTS

    params = {"LLM_MAX_BATCH_SIZE": "8"}
    assert engine_kwargs(params, "ort-cuda", static_flow_bundle)["settings"].graph_flow_overflow_slots \
        == OVERFLOW_FLOW_SLOTS
    zero = engine_kwargs({**params, "GRAPH_FLOW_OVERFLOW_SLOTS": " 0 "}, "ort-cuda", static_flow_bundle)
    assert zero["settings"].graph_flow_overflow_slots == 0
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(CosyEdgeError, match=f"GRAPH_FLOW_OVERFLOW_SLOTS must be a whole number of streams >= 0, "
                                                f"got '{bad}'"):
            engine_kwargs({**params, "GRAPH_FLOW_OVERFLOW_SLOTS": bad}, "ort-cuda", static_flow_bundle)


def test_triton_model_gather_parameter(static_flow_bundle: Path) -> None:
    """GRAPH_FLOW_GATHER_MS: later chunks' flow gathered (graph_flow_gather_ms), off when unset."""
    from cosyedge_cloud.triton.orchestrator import engine_kwargs

    params = {"LLM_MAX_BATCH_SIZE": "8"}
    assert engine_kwargs(params, "ort-cuda", static_flow_bundle)["settings"].graph_flow_gather_ms == 0.0
    got = engine_kwargs({**params, "GRAPH_FLOW_GATHER_MS": " 150 "}, "ort-cuda", static_flow_bundle)
    assert got["settings"].graph_flow_gather_ms == 150.0
    for bad in ("-1", "soon", "nan", "1001"):
        with pytest.raises(CosyEdgeError, match=f"GRAPH_FLOW_GATHER_MS must be a number of ms from 0 \\(off\\) to "
                                                f"1000, got '{bad}'"):
            engine_kwargs({**params, "GRAPH_FLOW_GATHER_MS": bad}, "ort-cuda", static_flow_bundle)


def test_triton_model_hop_growth_parameters(static_flow_bundle: Path) -> None:
    """STREAM_HOP_SCALE and STREAM_MAX_HOP_TOKENS: the growing hop and its cap, with the batch on the graphs, on
    the dynamic batchers, and with no batching; unset, the engine's fixed hop."""
    from cosyedge_cloud.triton.orchestrator import engine_kwargs

    grow = {"STREAM_HOP_SCALE": "2", "STREAM_MAX_HOP_TOKENS": " 50 "}
    graphs = engine_kwargs({"LLM_MAX_BATCH_SIZE": "8", **grow}, "ort-cuda", static_flow_bundle)["settings"]
    assert graphs.graph_batching and (graphs.hop_scale, graphs.max_hop_tokens) == (2.0, 50)
    dynamic = engine_kwargs({"LLM_MAX_BATCH_SIZE": "8", **grow}, "ort", static_flow_bundle)["settings"]
    assert not dynamic.graph_batching and (dynamic.hop_scale, dynamic.max_hop_tokens) == (2.0, 50)
    alone = engine_kwargs({"STREAM_HOP_SCALE": "1.5", "STREAM_MAX_HOP_TOKENS": "0"}, "ort")["settings"]
    assert alone.batching is None and (alone.hop_scale, alone.max_hop_tokens) == (1.5, None)
    assert engine_kwargs({}, "ort") == {}
    fixed = engine_kwargs({"LLM_MAX_BATCH_SIZE": "8"}, "ort-cuda", static_flow_bundle)["settings"]
    assert (fixed.hop_scale, fixed.max_hop_tokens) == (1.0, None)
    for bad in ("0.5", "fast", "nan", "5"):
        with pytest.raises(CosyEdgeError, match=f"STREAM_HOP_SCALE must be a number from 1 \\(a fixed hop\\) to 4, "
                                                f"got '{bad}'"):
            engine_kwargs({"STREAM_HOP_SCALE": bad}, "ort")
    for bad in ("-1", "fifty", "2.5"):
        with pytest.raises(CosyEdgeError, match=f"STREAM_MAX_HOP_TOKENS must be a whole number of speech tokens "
                                                f"\\(0: 4x the hop\\), got '{bad}'"):
            engine_kwargs({"STREAM_MAX_HOP_TOKENS": bad}, "ort")
