"""Fewer Euler steps for the first streaming chunk (SynthesisSettings.first_chunk_euler_steps,
FlowStream's `first_steps`) on the tiny bundle: the setting is checked with a clear message;
the default (and the bundle's own count) gives the same mel bit for bit; fewer steps change the
first chunk only, the next call fills every step's cache from the first chunk's frames, so the
later chunks equal the default's (the rule docs/engine.md states), with and without a voice's
primed prompt chunks; the fixed-shape flow graphs give the dynamic graph's audio with it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.flow import FlowPrompt, step_grid
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer, load_synthesizer

from tests.models.synthesis import test_flow_stream
from tests.models.synthesis.test_flow_stream import CHUNK_ATOL, chunks, tokens

voice = test_flow_stream.voice  # its zero-shot prompt fixture (prompt tokens off the chunk grid)


def test_step_grid_and_the_settings_messages(tiny_bundle: Path) -> None:
    # Evenly spread points of a 10-step grid, written out by hand.
    assert step_grid(10, None) == list(range(11))
    assert step_grid(10, 10) == list(range(11))
    assert step_grid(10, 5) == [0, 2, 4, 6, 8, 10]
    assert step_grid(10, 6) == [0, 2, 3, 5, 7, 8, 10]
    assert step_grid(10, 1) == [0, 10]
    with pytest.raises(ValueError, match=r"first_chunk_euler_steps must be >= 1 or None"):
        SynthesisSettings(first_chunk_euler_steps=0)
    with pytest.raises(ValueError, match=r"between 1 and the bundle's n_timesteps \(10\), got 11"):
        step_grid(10, 11)
    with pytest.raises(ValueError, match=r"between 1 and the bundle's n_timesteps"):
        load_synthesizer(tiny_bundle, settings=SynthesisSettings(first_chunk_euler_steps=1000))


def run(engine: CosyVoiceSynthesizer, voice: FlowPrompt, toks: np.ndarray, first_steps: int | None,
        prime: bool = False) -> list[np.ndarray]:
    look = engine.bundle.flow.pre_lookahead_len
    spans = chunks(engine, voice, len(toks), 25, 7)
    with engine.flow.stream(voice, "cached", first_steps=first_steps) as stream:
        if prime:
            stream.prime()
        mels = [stream.push(toks[: end + look]) for _, end in spans]
        mels.append(stream.finish(toks))
    return mels


def test_default_steps_leave_the_mel_unchanged(engine: CosyVoiceSynthesizer, voice: FlowPrompt) -> None:
    toks = tokens(engine, 60)
    base = run(engine, voice, toks, None)
    same = run(engine, voice, toks, engine.bundle.flow.n_timesteps)
    assert len(base) >= 3
    for a, b in zip(base, same, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("prime", [False, True], ids=["no-prefix", "primed-prompt"])
def test_fewer_first_steps_change_only_the_first_chunk(engine: CosyVoiceSynthesizer, voice: FlowPrompt,
                                                       prime: bool) -> None:
    toks = tokens(engine, 60)
    base = run(engine, voice, toks, None, prime)
    fast = run(engine, voice, toks, 3, prime)
    assert [m.shape for m in fast] == [m.shape for m in base]
    first, ref = fast[0], base[0]
    assert np.isfinite(first).all()
    # a coarser solve of the same ODE: different, but not another signal
    diff = float(np.abs(first - ref).mean())
    assert diff > 1e-3
    assert diff < float(np.abs(ref).mean())
    for later, default in zip(fast[1:], base[1:], strict=True):  # the filled caches: the default's chunks
        np.testing.assert_allclose(later, default, rtol=0, atol=CHUNK_ATOL)


def test_estimator_work_of_the_fill(engine: CosyVoiceSynthesizer, voice: FlowPrompt) -> None:
    """The fill runs the bundle's steps once over the first chunk's committed frames, after it."""
    toks = tokens(engine, 60)
    look = engine.bundle.flow.pre_lookahead_len
    n, k = engine.bundle.flow.n_timesteps, 4
    spans = chunks(engine, voice, len(toks), 25, 7)
    seen = {}
    for steps in (None, k):
        with engine.flow.stream(voice, "cached", first_steps=steps) as stream:
            stream.push(toks[: spans[0][1] + look])
            first = (stream.work.calls, stream.work.frames, stream.committed)
            for _, end in spans[1:]:
                stream.push(toks[: end + look])
            stream.finish(toks)
            seen[steps] = (first, stream.work.calls, stream.work.frames, stream.committed)
    (d_calls1, d_frames1, d_commit1), d_calls, d_frames, d_committed = seen[None]
    (calls1, frames1, commit1), calls, frames, committed = seen[k]
    window = d_frames1 // n
    assert (d_calls1, calls1, commit1) == (n, k, 0) and d_commit1 > 0  # nothing committed until the fill
    assert frames1 == k * window
    assert committed == d_committed and calls == d_calls + k
    # the default first window (n steps) becomes k steps over it plus the fill: n steps over its committed frames
    assert frames == d_frames - n * window + k * window + n * d_commit1


def test_fixed_shape_flow_with_fewer_first_steps(static_flow_bundle: Path) -> None:
    req = SynthesisRequest(text="Hello there, this is a first chunk test.", seed=5, stream=True)
    outs = {}
    for on in (False, True):
        eng = load_synthesizer(static_flow_bundle, "ort", SynthesisSettings(
            backend="ort", graph_flow=on, overlap_stages=False, first_chunk_euler_steps=4))
        try:
            outs[on] = np.concatenate([c.pcm for c in eng.synthesize(req)])
            if on:
                assert eng.static_flow is not None and eng.static_flow.replays > 0
        finally:
            eng.close()
    assert outs[True].shape == outs[False].shape
    np.testing.assert_allclose(outs[True], outs[False], rtol=0, atol=1e-4)


def test_the_engine_reads_the_setting(engine: CosyVoiceSynthesizer) -> None:
    """Per request, as the first-hop setting: the first chunk's audio changes, the chunking does not."""
    req = SynthesisRequest(text="The engine answers a little sooner.", seed=3, stream=True)
    base = [c.pcm for c in engine.synthesize(req)]
    original = engine.settings
    engine.settings = dataclasses.replace(original, first_chunk_euler_steps=3)
    try:
        fast = [c.pcm for c in engine.synthesize(req)]
    finally:
        engine.settings = original
    assert len(base) >= 2 and [p.size for p in fast] == [p.size for p in base]
    assert float(np.abs(fast[0] - base[0]).max()) > 1e-3
