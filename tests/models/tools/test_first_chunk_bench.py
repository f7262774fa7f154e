"""`cosyedge bench --first-chunk` (models/tools/first_chunk_bench.py) on the tiny bundle: the
pairs are parsed with clear errors; the default row equals the default exactly; fewer first-chunk
steps change the first chunk and leave the later frames at the same hop's."""

from __future__ import annotations

import math

import pytest
from cosyedge_models.errors import CosyEdgeError
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer
from cosyedge_models.tools.first_chunk_bench import first_chunk_sweep, parse_combos


def test_parse_combos() -> None:
    assert parse_combos("15:6, 25:0,10") == [(15, 6), (25, 0), (10, 0)]
    with pytest.raises(CosyEdgeError, match="HOP:STEPS pairs"):
        parse_combos("15:six")
    with pytest.raises(CosyEdgeError, match=">= 0"):
        parse_combos("-1:6")


def test_sweep_against_the_default(engine: CosyVoiceSynthesizer) -> None:
    report = first_chunk_sweep(engine, "A first chunk sooner.", [(15, 3)], repeats=1)
    base, fast = report["combinations"]
    assert report["n_timesteps"] == engine.bundle.flow.n_timesteps
    assert math.isinf(base["first_chunk_vs_default"]["mel_snr_db"]) and base["utterance_vs_default"]["mel_l1"] == 0
    assert fast["first_hop_tokens"] == 15 and fast["first_chunk_euler_steps"] == 3
    assert fast["first_chunk_frames"] < base["first_chunk_frames"]
    assert fast["first_chunk_estimator_frames"] < base["first_chunk_estimator_frames"]
    steps_only = fast["first_chunk_vs_same_hop"]
    assert steps_only["mel_l1"] > 0 and math.isfinite(steps_only["mel_snr_db"])
    assert fast["later_max_abs_vs_same_hop"] < 1e-4  # the filled caches: the later chunks are the same hop's
    assert fast["first_audio_ms"] > 0 and engine.settings.first_chunk_euler_steps is None  # restored
