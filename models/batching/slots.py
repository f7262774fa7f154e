"""Slot and padding bookkeeping of a batched LLM KV cache. Pure logic: it
plans the cache edits as ops that an executor applies (models/batching/kv.py on
host arrays; a device executor could apply the same ops with 2-D copies).

The cache is `[L, 2, B, Hkv, W, hd]`: one batch row per active request,
`W` columns shared by all rows. Every row is right-aligned (left padding):
row r's `len_r` valid positions are the last `len_r` columns and the first
`W - len_r` are padding that the attention mask zeroes. The decode graph
derives position ids from cumsum(mask), so padding does not shift a row's
positions, and its keys were rotated (RoPE) at their true positions when
they were computed, so moving a row's columns is harmless.

* join: a prefilled request brings a cache of `T` positions. If `T <= W` it
  becomes a new row with `W - T` padding columns in front; if `T > W` every
  existing row first gets `T - W` more padding columns in front.
* step: all rows advance together; the new column is valid in every row.
* leave: the row is removed. Columns that are padding in every remaining row
  (the shared leading padding) are dropped once there are at least
  `compact_min_columns` of them, so a long request that left does not keep
  every later step paying for its length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PadColumns:
    """Insert `count` padding columns in front of every existing row."""

    count: int


@dataclass(frozen=True)
class AppendRow:
    """Append the joining request's cache as the last row, after `pad` padding columns."""

    pad: int


@dataclass(frozen=True)
class DropRow:
    index: int


@dataclass(frozen=True)
class DropColumns:
    """Drop the first `count` columns (padding in every row)."""

    count: int


SlotOp = PadColumns | AppendRow | DropRow | DropColumns


class SlotTable:
    """Which request owns which batch row, and how long each row's valid cache is."""

    def __init__(self, compact_min_columns: int = 1) -> None:
        if compact_min_columns < 1:
            raise ValueError(f"compact_min_columns must be >= 1, got {compact_min_columns}")
        self.compact_min_columns = compact_min_columns
        self.width = 0  # W: columns of the cache
        self._ids: list[int] = []  # row order
        self._lens: list[int] = []

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, rid: int) -> bool:
        return rid in self._ids

    @property
    def ids(self) -> list[int]:
        return list(self._ids)

    def length(self, rid: int) -> int:
        return self._lens[self._ids.index(rid)]

    def row(self, rid: int) -> int:
        return self._ids.index(rid)

    def shared_padding(self) -> int:
        """Leading columns that are padding in every row."""
        return self.width - max(self._lens) if self._lens else self.width

    def join(self, rid: int, cache_len: int) -> list[SlotOp]:
        if rid in self._ids:
            raise ValueError(f"request {rid!r} already holds a batch row")
        if cache_len < 1:
            raise ValueError(f"a joining cache needs >= 1 position, got {cache_len}")
        ops: list[SlotOp] = []
        if cache_len > self.width:
            if self._ids:
                ops.append(PadColumns(cache_len - self.width))
            self.width = cache_len
        ops.append(AppendRow(self.width - cache_len))
        self._ids.append(rid)
        self._lens.append(cache_len)
        return ops

    def advance(self) -> None:
        """After a decode step appended one column to every row."""
        self.width += 1
        self._lens = [n + 1 for n in self._lens]

    def leave(self, rid: int) -> list[SlotOp]:
        i = self._ids.index(rid)
        del self._ids[i]
        del self._lens[i]
        ops: list[SlotOp] = [DropRow(i)]
        if not self._ids:
            self.width = 0  # the executor drops the whole (now empty) cache
            return ops
        shared = self.shared_padding()
        if shared >= self.compact_min_columns:
            ops.append(DropColumns(shared))
            self.width -= shared
        return ops

    def mask(self) -> np.ndarray:
        """[B, W + 1] int64 attention mask of the next decode step: each row's
        valid columns plus the new token."""
        mask = np.zeros((len(self._ids), self.width + 1), dtype=np.int64)
        for r, n in enumerate(self._lens):
            mask[r, self.width - n:] = 1
        return mask
