"""The typed interface of one LLM decode step for several streams at once over
fixed shapes: what the iteration-level scheduler (models/batching/iteration.py,
models/batching/graph_batcher.py) drives, and what a batched step graph
implements (a graph per captured batch size; each stream's KV cache in a row of
one device buffer, per-row cache lengths). numpy only, so that an onnxruntime
and a TensorRT runtime can both implement it.

The contract, per row (a KV-cache slot, 0 <= row < `rows`):

* `prefill(row, embeds, past)` writes the prompt's cache into the row and
  returns the prompt's last log-probabilities [1, V]. It runs on the caller's
  thread (dynamic sessions, never captured).
* `prefill_rows(rows, prompts, pasts)` (where `batched_prefill`) writes several
  prompts' caches, each but its last position, in one run: that position is
  then the row's first step's input, and its logp the prompt's. Where
  `captured_prefill`, it runs ON THE GPU GRAPH THREAD (fixed-length prefill
  graphs captured there), else on the caller's thread.
* `step(rows, embeds, lengths, batch_size)` runs ON THE GPU GRAPH THREAD
  (models/backends/graph_thread.py; captured graphs live there): one token for
  each of `rows`, whose new K/V is written at its `lengths[i]` (the row's
  cache length before the step) and attends to positions < lengths[i] + 1
  only. It runs the graph captured for `batch_size` (one of `batch_sizes`,
  >= len(rows)); the rows beyond len(rows) are padding whose results are
  dropped and whose caches are not those of any stream. Returns logp [n, V]
  in the order of `rows`. A row's result must not depend on which other rows
  share the step (that is what makes a seeded stream's tokens the same alone
  and batched)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class BatchedDecodeStep(Protocol):
    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """The captured batch sizes, ascending."""
        ...

    @property
    def rows(self) -> int:
        """KV-cache rows (streams that can be in flight at once)."""
        ...

    @property
    def positions(self) -> int:
        """Cache positions of one row: prompt + generated tokens of a stream at most."""
        ...

    @property
    def takes_past(self) -> bool:
        """Whether `prefill` can start from a saved prefix cache (a voice's LLM prefix)."""
        ...

    def prefill(self, row: int, inputs_embeds: np.ndarray, past: np.ndarray | None = None) -> np.ndarray:
        """The prompt [1, T, D] (after `past`, a saved prefix cache, if given) into `row`; logp [1, V]."""
        ...

    @property
    def batched_prefill(self) -> bool:
        """Whether `prefill_rows` runs (several prompts in one prefill run)."""
        ...

    @property
    def captured_prefill(self) -> bool:
        """Whether `prefill_rows` runs captured graphs (then on the graph thread, for every prompt)."""
        ...

    def prefill_rows(self, rows: Sequence[int], prompts: Sequence[np.ndarray],
                     pasts: Sequence[np.ndarray] | None = None) -> None:
        """The prompts ([1, T_j, D], T_j >= 2; after `pasts`, each prompt's saved prefix [L, 2, 1, Hkv, P, hd],
        one length P) into `rows` in one run, each but its last position (the row's cache length: P + T_j - 1).
        A prefix array is a voice's and not written after it is made: a step may keep it on the device by
        its identity."""
        ...

    def step(self, rows: Sequence[int], inputs_embeds: np.ndarray, lengths: Sequence[int],
             batch_size: int) -> np.ndarray:
        """On the graph thread: one step for `rows` (inputs_embeds [n, D]) as the `batch_size` graph; logp [n, V]."""
        ...


def padded_size(n: int, batch_sizes: Sequence[int]) -> int:
    """The smallest captured batch size that holds `n` rows."""
    for size in sorted(batch_sizes):
        if size >= n:
            return size
    raise ValueError(f"{n} rows exceed the largest captured batch size ({max(batch_sizes, default=0)})")


def check_batch_sizes(batch_sizes: Sequence[int]) -> tuple[int, ...]:
    """Ascending, distinct, >= 1; the error names what is wrong."""
    sizes = tuple(batch_sizes)
    if not sizes or any(s < 1 for s in sizes) or list(sizes) != sorted(set(sizes)):
        raise ValueError(f"batch_sizes must be distinct ascending sizes >= 1 (e.g. 1, 2, 4, 8), got {list(sizes)}")
    return sizes
