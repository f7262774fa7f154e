"""graph_batcher.prefill_batches: which of a round's prefills share one run (llm_batched_prefill)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import numpy as np
from cosyedge_models.batching.graph_batcher import _Prefill, prefill_batches


def _planned(positions: int, past: int | None, finished: bool = False) -> _Prefill:
    request = cast(Any, SimpleNamespace(decode=SimpleNamespace(finished=finished)))
    kv = None if past is None else np.zeros((2, 2, 1, 1, past, 4), np.float32)
    return _Prefill(request, 0, np.zeros((1, positions, 8), np.float32), kv)


def test_prompts_share_a_run_by_their_past_length() -> None:
    plain = [_planned(5, None), _planned(9, None)]
    voiced = [_planned(3, 4), _planned(7, 4)]
    other_voice = _planned(6, 6)  # a past of another length: alone
    short = _planned(1, None)  # one position: nothing to prefill before its first step
    done = _planned(5, None, finished=True)  # no tokens to make: the row-by-row path ends it
    planned = [plain[0], voiced[0], other_voice, short, plain[1], done, voiced[1]]
    batches = prefill_batches(planned)
    assert batches == [plain, voiced]
    assert [p.batched for p in planned] == [True, True, False, False, True, False, True]


def test_one_prompt_of_a_kind_runs_alone() -> None:
    planned = [_planned(5, None), _planned(5, 4)]
    assert prefill_batches(planned) == [] and not any(p.batched for p in planned)
