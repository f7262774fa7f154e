"""The batched decode core: one KV cache with a row per active request, kept
as a host array and run through `llm_decode` with B > 1. Prefill stays
batch-1 (a joining request's prompt is computed alone, exactly as on the
unbatched path) and its cache is then left-padded into the batch.

It uses plain `Session.run`, so it works with every backend's sessions; on
a GPU backend the cache crosses to the host and back once per step (a
device-resident executor of the same `SlotOp`s is future work, see
models/batching/slots.py). Not thread-safe: the batcher's worker owns it."""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping

import numpy as np
from cosyedge_models.backends.base import Session
from cosyedge_models.batching.slots import AppendRow, DropColumns, DropRow, PadColumns, SlotOp, SlotTable

log = logging.getLogger(__name__)

_ROW_AXIS, _COL_AXIS = 2, 4  # of [L, 2, B, Hkv, W, hd]


def _pad_front(kv: np.ndarray, count: int) -> np.ndarray:
    if count == 0:
        return kv
    widths = [(0, 0)] * kv.ndim
    widths[_COL_AXIS] = (count, 0)
    return np.pad(kv, widths)


def apply_op(kv: np.ndarray | None, op: SlotOp, joining: np.ndarray | None = None) -> np.ndarray | None:
    """One op on a host cache; `joining` is the [L, 2, 1, Hkv, T, hd] cache of an AppendRow."""
    if isinstance(op, PadColumns):
        assert kv is not None
        return _pad_front(kv, op.count)
    if isinstance(op, AppendRow):
        if joining is None:
            raise ValueError("AppendRow needs the joining request's cache")
        row = _pad_front(joining, op.pad)
        return row if kv is None else np.concatenate((kv, row), axis=_ROW_AXIS)
    assert kv is not None
    if isinstance(op, DropRow):
        if kv.shape[_ROW_AXIS] == 1:
            return None
        return np.delete(kv, op.index, axis=_ROW_AXIS)
    # DropColumns: a copy, so the dropped columns' memory is released.
    return np.ascontiguousarray(kv[:, :, :, :, op.count:])


class BatchDecoder:
    def __init__(self, prefill: Session, decode: Session, *, compact_min_columns: int = 1) -> None:
        self._prefill = prefill
        self._decode = decode
        self.slots = SlotTable(compact_min_columns)
        self._kv: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def width(self) -> int:
        return self.slots.width

    def prefill(self, inputs_embeds: np.ndarray, past: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """inputs_embeds [1, T, D] (after `past` [L, 2, 1, Hkv, P, hd], a voice's
        saved prefix, when given) -> (logp [1, V], cache [L, 2, 1, Hkv, P + T, hd]), batch-1."""
        if past is None:
            mask = np.ones(inputs_embeds.shape[:2], dtype=np.int64)
            out = self._prefill.run({"inputs_embeds": inputs_embeds, "attention_mask": mask})
        else:
            mask = np.ones((1, past.shape[4] + inputs_embeds.shape[1]), dtype=np.int64)
            out = self._decode.run({"inputs_embeds": inputs_embeds, "attention_mask": mask, "past_kv": past})
        return out["logp"], out["present_kv"]

    def join(self, rid: int, cache: np.ndarray) -> None:
        """Add a prefilled request's cache as a row. All or nothing: if an op
        fails (memory), the batch is left as it was."""
        before = copy.deepcopy(self.slots)
        kv = self._kv
        try:
            for op in self.slots.join(rid, int(cache.shape[_COL_AXIS])):
                kv = apply_op(kv, op, cache)
        except BaseException:
            self.slots = before
            raise
        self._kv = kv

    def leave(self, rid: int) -> None:
        for op in self.slots.leave(rid):
            if isinstance(op, DropColumns):
                log.debug("dropping %d shared padding columns", op.count)
            self._kv = apply_op(self._kv, op)

    def step(self, inputs: Mapping[int, np.ndarray]) -> dict[int, np.ndarray]:
        """One decode step for every row: `inputs` maps each active request to
        its next input embedding [D]; returns each request's logp [V]."""
        ids = self.slots.ids
        if not ids or self._kv is None:
            return {}
        missing = [rid for rid in ids if rid not in inputs]
        if missing:
            raise ValueError(f"no input for batch rows {missing}")
        embeds = np.stack([inputs[rid] for rid in ids])[:, None, :].astype(np.float32, copy=False)
        out = self._decode.run({"inputs_embeds": embeds, "attention_mask": self.slots.mask(), "past_kv": self._kv})
        self._kv = out["present_kv"]
        self.slots.advance()
        logp = out["logp"]
        return {rid: logp[r] for r, rid in enumerate(ids)}

    def reset(self) -> list[int]:
        """Drop every row (after a failed step, whose cache is not trusted); returns their ids."""
        ids = self.slots.ids
        self.slots = SlotTable(self.slots.compact_min_columns)
        self._kv = None
        return ids
