"""models/streaming.ChunkSchedule with a growing hop (upstream's stream_scale_factor)."""

from __future__ import annotations

import pytest
from cosyedge_models.synthesis.streaming import ChunkSchedule


def _chunks(schedule: ChunkSchedule, n_tokens: int) -> list[tuple[int, int]]:
    out = []
    for n in range(n_tokens + 1):
        while (c := schedule.next_chunk(n)) is not None:
            out.append((c.start, c.end))
    return out


def test_hop_doubles_up_to_four_times_and_stays_aligned() -> None:
    s = ChunkSchedule(hop=25, lookahead=3, prompt_tokens=40, hop_scale=2.0)
    chunks = _chunks(s, 600)
    sizes = [end - start for start, end in chunks]
    assert sizes[:5] == [35, 50, 100, 100, 100]  # first hop aligned to the prompt: 40 + 35 = 75
    assert all((40 + end) % 25 == 0 for _, end in chunks)  # every chunk ends on a flow mask chunk
    assert chunks[0][0] == 0 and all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))
    assert s.final_chunk(600).start == chunks[-1][1]


def test_fixed_hop_by_default_and_custom_cap() -> None:
    assert [e - b for b, e in _chunks(ChunkSchedule(hop=25, lookahead=3), 200)] == [25] * 7
    sizes = [e - b for b, e in _chunks(ChunkSchedule(hop=10, lookahead=0, hop_scale=1.5, max_hop=20), 120)]
    assert sizes[:4] == [10, 15, 20, 20] and max(sizes) == 20
    with pytest.raises(ValueError, match="hop_scale must be >= 1.0"):
        ChunkSchedule(hop=25, lookahead=3, hop_scale=0.5)
    with pytest.raises(ValueError, match="max_hop must be >= hop"):
        ChunkSchedule(hop=25, lookahead=3, max_hop=10)


def test_engine_streams_with_growing_hop(tiny_bundle: object) -> None:
    import numpy as np
    from cosyedge_models.synthesis.api import SynthesisRequest
    from cosyedge_models.synthesis.settings import SynthesisSettings
    from cosyedge_models.synthesis.synthesizer import load_synthesizer

    text = "The kiosk greets every visitor and explains the opening hours of the museum."
    counts, lengths = [], []
    for scale in (1.0, 2.0):
        engine = load_synthesizer(tiny_bundle, settings=SynthesisSettings(hop_scale=scale))  # type: ignore[arg-type]
        try:
            chunks = list(engine.synthesize(SynthesisRequest(text=text, stream=True, seed=3)))
        finally:
            engine.close()
        pcm = np.concatenate([c.pcm for c in chunks])
        assert np.isfinite(pcm).all() and chunks[-1].last
        counts.append(len(chunks))
        lengths.append(pcm.size)
    assert lengths[0] == lengths[1]  # same tokens (same seed), same audio length
    assert counts[1] < counts[0], counts


@pytest.mark.parametrize(("first_hop", "prompt_tokens"), [(None, 0), (None, 10), (15, 10), (7, 0)])
def test_first_chunk_tokens_is_where_the_first_chunk_becomes_ready(first_hop: int | None, prompt_tokens: int) -> None:
    schedule = ChunkSchedule(25, 3, prompt_tokens=prompt_tokens, first_hop=first_hop)
    need = schedule.first_chunk_tokens()
    assert need == (first_hop if first_hop is not None else 25 + (-prompt_tokens % 25)) + 3
    assert schedule.next_chunk(need - 1) is None
    chunk = schedule.next_chunk(need)
    assert chunk is not None and chunk.start == 0 and chunk.end == need - 3
