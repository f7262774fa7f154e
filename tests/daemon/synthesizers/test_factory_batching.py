"""`[tts] llm_max_batch_size` / `llm_max_queue_delay_ms` reach the engine's LLM batcher,
`flow_max_batch_size` / `flow_max_queue_delay_ms` its flow and vocoder batchers."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from cosyedge_daemon.settings.schema import Settings
from cosyedge_daemon.settings.tts import TtsSettings
from cosyedge_daemon.synthesizers.factory import load_local_synthesizer
from cosyedge_models.synthesis.api import SynthesisRequest


def test_batching_settings_reach_the_engine(tiny_bundle: Path) -> None:
    off = load_local_synthesizer(Settings(device_id="t"), bundle=str(tiny_bundle))
    on = load_local_synthesizer(Settings(device_id="t", tts=TtsSettings(llm_max_batch_size=3, llm_max_queue_delay_ms=5,
                                                                   flow_max_batch_size=2, flow_max_queue_delay_ms=1.5)),
                           bundle=str(tiny_bundle))
    try:
        assert getattr(off, "batcher", "missing") is None
        assert getattr(off, "stage_batchers", "missing") == []
        batcher = getattr(on, "batcher", None)
        assert batcher is not None
        assert (batcher.settings.max_batch_size, batcher.settings.max_queue_delay_ms) == (3, 5)
        stages = getattr(on, "stage_batchers", [])
        assert [s.name for s in stages] == ["flow_estimator", "hift_source", "hift_decoder"]
        assert {(s.settings.max_batch_size, s.settings.max_queue_delay_ms) for s in stages} == {(2, 1.5)}
    finally:
        off.close()
        on.close()


def test_streaming_settings_reach_the_engine(tiny_bundle: Path, tmp_path: Path) -> None:
    from cosyedge_daemon.settings.loader import load_settings
    from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer

    defaults = load_local_synthesizer(Settings(device_id="t"), bundle=str(tiny_bundle))
    config = tmp_path / "cosyedge.toml"
    config.write_text('device_id = "t"\n[tts]\noverlap_stages = "off"\nfirst_hop_tokens = 7\nstream_hop_scale = 2.0\n'
                      'stream_max_hop_tokens = 50\nflow_final_chunk = "upstream"\nflow_left_chunks = 4\n'
                      'cpu_memory_arena = true\n'
                      'max_text_chars = 1234\noffline_as_stream = "on"\nvocoder_pad_final = "off"\n')
    custom = load_local_synthesizer(load_settings(config), bundle=str(tiny_bundle))
    try:
        assert isinstance(defaults, CosyVoiceSynthesizer) and isinstance(custom, CosyVoiceSynthesizer)
        d, c = defaults.settings, custom.settings
        assert (d.overlap_stages, d.first_hop_tokens, d.flow_final_chunk, d.flow_left_chunks) == (
            None, None, "cached", -1)
        assert (c.overlap_stages, c.first_hop_tokens, c.flow_final_chunk, c.flow_left_chunks) == (
            False, 7, "upstream", 4)
        assert (d.hop_scale, c.hop_scale) == (1.0, 2.0)
        assert (d.max_hop_tokens, c.max_hop_tokens) == (None, 50)  # 0: upstream's 4 x the hop
        # auto: off without batched lanes; "on" reaches the engine
        assert (d.offline_as_stream, c.offline_as_stream) == (None, True)
        assert (defaults.offline_as_stream, custom.offline_as_stream) == (False, True)
        assert (d.vocoder_pad_final, c.vocoder_pad_final) == (None, False)
        assert (d.cpu_memory_arena, c.cpu_memory_arena) == (False, True)
        # the one text limit: [tts] max_text_chars reaches the synthesizer's own check
        assert (d.max_text_chars, c.max_text_chars) == (4000, 1234)
        assert (defaults.frontend.max_text_chars, custom.frontend.max_text_chars) == (4000, 1234)
    finally:
        defaults.close()
        custom.close()


def test_graph_batching_settings_reach_the_engine(tiny_bundle: Path) -> None:
    from cosyedge_models.batching.llm_batcher import LlmBatcher
    from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer

    tts = TtsSettings(llm_max_batch_size=2, graph_batching=True, llm_prefills_between_steps=3,
                      llm_first_chunk_priority="first_audio", llm_parallel_prefills=3, graph_threads="per-stage",
                      llm_batched_prefill=True)
    engine = load_local_synthesizer(Settings(device_id="t", tts=tts), bundle=str(tiny_bundle))
    try:
        assert isinstance(engine, CosyVoiceSynthesizer)
        assert (engine.settings.graph_batching, engine.settings.llm_prefills_between_steps) == (True, 3)
        assert engine.settings.llm_first_chunk_priority == "first_audio" and engine.settings.llm_parallel_prefills == 3
        assert engine.settings.graph_threads == "per-stage" and engine.settings.llm_batched_prefill
        # this bundle has no fixed-size decode step: the dynamic-graph batcher serves the batch
        assert isinstance(engine.batcher, LlmBatcher)
    finally:
        engine.close()


def test_the_default_voice_is_prepared_at_load(static_flow_bundle: Path, tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """The daemon's default voice gets its prompt caches (and on a GPU with graph_flow_batch, its flow prefix
    in every batched lane: tests/models/batching/test_flow_batcher.py) before the first request; an
    unknown default voice is logged, and the engine serves."""
    from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer

    from tests.models.batching.test_flow_batcher import bundle_with_voice

    caplog.set_level(logging.INFO, logger="cosyedge_daemon.synthesizers.factory")
    bundle = bundle_with_voice(static_flow_bundle, tmp_path)
    engine = load_local_synthesizer(Settings(device_id="t", tts=TtsSettings(default_voice="alice")),
                                    bundle=str(bundle))
    try:
        assert isinstance(engine, CosyVoiceSynthesizer)
        # the flow prefix and the LLM prefix of the voice, built before any request
        assert engine.voice_cache.part_nbytes("flow") > 0 and engine.voice_cache.part_nbytes("llm") > 0
        assert "default voice 'alice' prepared (0 batched flow lanes seeded)" in caplog.text  # no lanes on the CPU
    finally:
        engine.close()
    unknown = load_local_synthesizer(Settings(device_id="t", tts=TtsSettings(default_voice="nobody")),
                                     bundle=str(bundle))
    try:
        assert "default voice 'nobody' not prepared: unknown voice 'nobody'" in caplog.text
        assert next(iter(unknown.synthesize(SynthesisRequest(text="Still here.", voice="alice", mode="zero_shot",
                                                              seed=1)))).pcm.size > 0
    finally:
        unknown.close()


def test_an_unknown_first_chunk_priority_is_refused_with_the_allowed_values() -> None:
    from cosyedge_models.synthesis.settings import SynthesisSettings

    with pytest.raises(ValueError, match="llm_first_chunk_priority must be one of normal, first_audio, got 'soon'"):
        SynthesisSettings(llm_first_chunk_priority="soon")


def test_parallel_prefills_outside_their_range_are_refused_with_the_range() -> None:
    from cosyedge_models.synthesis.settings import SynthesisSettings

    for bad in (0, 17):
        with pytest.raises(ValueError, match=f"llm_parallel_prefills must be 1 .. 16 threads, got {bad}"):
            SynthesisSettings(llm_parallel_prefills=bad)
