"""edge_build/tools/device_probe.py on the CPU: the stage times, the estimator
feeds the graph accepts, the per-stage profile, and the GPU part skipped
with its reason."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from cosyedge_build.tools.device_probe import estimator_feeds, main, vocoder_feeds
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import load_synthesizer


def test_probe_on_the_cpu_reports_stages_and_skips_the_gpu_part(tiny_bundle: Path, tmp_path: Path) -> None:
    assert main(["--bundle", str(tiny_bundle), "--backend", "ort", "--out", str(tmp_path),
                 "--frames", "40", "--repeats", "1"]) == 0
    report = json.loads((tmp_path / "probe.json").read_text())
    off = report["offline"]
    assert off["llm_tokens"] > 0 and off["flow_ms"] > 0 and off["audio_s"] > 0
    assert report["estimator"][0]["frames"] == 40
    assert "CUDAExecutionProvider" in report["estimator"][0]["skipped"]
    assert "CUDAExecutionProvider" in report["conv_variants"]["hift_decoder_56"]["skipped"]
    assert "flow_estimator:" in (tmp_path / "profile.txt").read_text()


def test_estimator_and_vocoder_feeds_run_on_their_graphs(tiny_bundle: Path) -> None:
    engine = load_synthesizer(tiny_bundle, settings=SynthesisSettings(threads=1, overlap_stages=False))
    try:
        out = engine.flow.estimator.run(estimator_feeds(engine, 30))
        audio = engine.vocoder.decoder_session.run(vocoder_feeds(engine, 20))["audio"]
    finally:
        engine.close()
    assert out["dphi_dt"].shape == (2, engine.flow.mel_bins, 30)
    assert np.isfinite(out["dphi_dt"]).all()
    assert audio.shape == (1, 20 * engine.vocoder.upsample) and np.isfinite(audio).all()


def test_probe_compares_fixed_size_and_dynamic_decode(tiny_static_bundle: Path) -> None:
    from cosyedge_build.tools.device_probe import offline_run
    from cosyedge_models.synthesis.api import SynthesisRequest

    request = SynthesisRequest(text="Two ways to decode.", stream=False, seed=2)
    fixed = offline_run(tiny_static_bundle, "ort", SynthesisSettings(threads=1, graph_decode=True), request)
    dynamic = offline_run(tiny_static_bundle, "ort", SynthesisSettings(threads=1, graph_decode=False), request)
    assert fixed["fixed_size_decode"] and not dynamic["fixed_size_decode"]
    assert fixed["llm_tokens"] == dynamic["llm_tokens"] > 0
