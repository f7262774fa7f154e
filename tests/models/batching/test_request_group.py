"""A request group (models/batching/group.py): the members of one Triton
batch start decoding at one step boundary, whoever reaches the LLM first."""

from __future__ import annotations

import pytest
from cosyedge_models.batching.group import RequestGroup
from cosyedge_models.batching.llm_batcher import LlmBatcher
from cosyedge_models.batching.policy import BatchSettings
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer

from tests.models.batching.test_batching import FakeClock, alone, llm_input, sampler


def test_group_holds_until_every_member_submitted_or_ended() -> None:
    group = RequestGroup(size=3, deadline=10.0)
    assert group.blocks(waiting=2, now=0.0)
    group.ended()  # the third failed in its text front end
    assert not group.blocks(waiting=2, now=0.0)
    assert not group.blocks(waiting=0, now=0.0)  # released for good
    group.ended()  # after the release a member's end changes nothing
    assert not group.blocks(waiting=0, now=0.0)


def test_group_deadline_and_bad_size() -> None:
    group = RequestGroup(size=4, deadline=10.0)
    assert group.blocks(waiting=1, now=9.99)
    assert not group.blocks(waiting=1, now=10.0)
    with pytest.raises(ValueError, match="at least 1"):
        RequestGroup(size=0, deadline=1.0)


def test_members_join_at_one_step_and_decode_as_alone(engine: CosyVoiceSynthesizer) -> None:
    lm = engine.lm
    clock = FakeClock()
    batcher = LlmBatcher(lm, BatchSettings(max_batch_size=4, compact_min_columns=1), clock=clock)
    seeds = {0: 31, 1: 32, 3: 33}
    with batcher.group(size=4, timeout_s=5.0) as group:
        streams = {}
        for i in (0, 1):  # the first two reach the LLM ...
            streams[i] = batcher.submit(llm_input(engine, i), sampler(lm, seeds[i]))
            worked, wake_at = batcher.run_once()
            assert (worked, batcher.active, wake_at) == (False, 0, 5.0)  # ... and wait for the rest
        group.ended()  # one member failed before the LLM
        streams[3] = batcher.submit(llm_input(engine, 3), sampler(lm, seeds[3]))
        batcher.run_once()
        assert batcher.active == 3 and batcher.waiting == 0  # all three joined at one step
        assert batcher.stats.peak_batch == 3
        while batcher.active:
            batcher.run_once()
    tokens = {i: list(stream) for i, stream in streams.items()}
    assert all(tokens[i] == alone(engine, i, seeds[i]) for i in streams)
    assert all(s._request.decode.stats.batch_max == 3 for s in streams.values())


def test_an_unfilled_group_lets_its_members_go_at_the_timeout(engine: CosyVoiceSynthesizer) -> None:
    lm = engine.lm
    clock = FakeClock()
    batcher = LlmBatcher(lm, BatchSettings(max_batch_size=4), clock=clock)
    with batcher.group(size=2, timeout_s=0.5):
        stream = batcher.submit(llm_input(engine, 2), sampler(lm, 1))
        batcher.run_once()
        assert batcher.active == 0
        clock.t = 0.5
        batcher.run_once()
        assert batcher.active == 1 or batcher.waiting == 0
    stream.close()
