"""Where the LLM's KV cache lives between decode steps on a GPU backend, as a
plan of buffer roles and device copies. Pure logic: the TensorRT decode loop
executes the plan with CUDA copies, the tests execute it with numpy over
onnxruntime and compare with the plain host loop.

The cache tensor is `[L, 2, B, Hkv, n, hd]`: `rows = L*2*B*Hkv` rows of
`n * hd` elements, so a cache of length n has a row pitch of
`n * hd * itemsize` bytes. Two device buffers `a` and `b`, each sized for the
longest cache, hold past and present.

Two modes:

* exact: the decode graph runs at the true past length P; its present output
  (P + 1 positions) is the next step's past, so the buffers swap roles
  (ping-pong) and nothing is copied. Every step has a new shape, so a CUDA
  graph cannot be replayed.
* bucketed (CUDA graphs): the past is laid out at a fixed bucket length
  `pb >= P` (64, 128, ... up to the profile's max); positions P..pb-1 are
  padding that the attention mask zeroes, and the new token sits at index pb
  with mask 1, so its position id (cumsum(mask) - 1) is P, as in the exact
  mode. Shapes stay fixed inside a bucket, so one captured CUDA graph per
  bucket is replayed step after step. After each step only the new position
  (`rows x hd` elements) is copied from present[pb] to past[P] and mask[P] is
  set to 1; crossing into the next bucket re-lays the cache out once.
  Past is always `a`, present always `b`, so a graph depends on pb alone.
  This relies on the decode graph honouring mask zeros anywhere (BUNDLE.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from cosyedge_models.errors import SynthesisError


@dataclass(frozen=True)
class Copy2D:
    """`height` rows of `width` bytes from src to dst (cuMemcpy2D semantics)."""

    src: str
    dst: str
    src_offset: int
    src_pitch: int
    dst_offset: int
    dst_pitch: int
    width: int
    height: int


@dataclass(frozen=True)
class MaskSet:
    """Set mask[index] = 1 in the device mask buffer."""

    index: int


@dataclass(frozen=True)
class MaskFill:
    """Upload the whole mask (`valid` ones, padding zeros, a one at `bucket`)."""

    valid: int
    bucket: int


Op = Copy2D | MaskSet | MaskFill


def decode_buckets(p_min: int, p_max: int, smallest: int = 64) -> list[int]:
    """Bucket lengths for the bucketed mode: powers of two from `smallest`,
    clipped to the decode profile's [p_min, p_max], ending at p_max."""
    if p_max < 1 or p_min > p_max:
        raise ValueError(f"bad decode profile range [{p_min}, {p_max}]")
    out, b = [], max(1, smallest)
    while b < p_max:
        if b >= p_min:
            out.append(b)
        b *= 2
    out.append(p_max)
    return out


def bucket_mask(valid: int, bucket: int) -> np.ndarray:
    """[1, bucket + 1] int64: ones for the valid past and the new token."""
    mask = np.zeros((1, bucket + 1), dtype=np.int64)
    mask[0, :valid] = 1
    mask[0, bucket] = 1
    return mask


class KvPlan:
    """The cache bookkeeping of one request. Call `start(T)` after the prefill
    wrote its present (T positions) into buffer `b`, then for every decode
    step read `past_dim`, `past_buf`, `present_buf`, run the step, and apply
    `advance()`'s ops."""

    def __init__(self, rows: int, head_dim: int, itemsize: int, p_max: int,
                 buckets: list[int] | None) -> None:
        self.rows = rows
        self.row_bytes = head_dim * itemsize  # one position of one row
        self.p_max = p_max
        self.buckets = sorted(buckets) if buckets else None
        self.past_len = 0
        self.bucket = 0
        self.past_buf = "b"

    @property
    def bucketed(self) -> bool:
        return self.buckets is not None

    @property
    def present_buf(self) -> str:
        return "a" if self.past_buf == "b" else "b"

    @property
    def past_dim(self) -> int:
        """Length dimension of the past_kv input for the next step."""
        return self.bucket if self.bucketed else self.past_len

    def capacity_positions(self) -> int:
        """Positions each buffer must hold: the longest present (past + 1)."""
        return self.p_max + 1

    def bucket_for(self, length: int) -> int:
        if length > self.p_max:
            raise SynthesisError(
                f"llm_decode: the KV cache would grow to {length} positions, past the engine's maximum "
                f"of {self.p_max}; rebuild the engines with a larger llm_decode profile or send shorter text")
        assert self.buckets is not None
        return next(b for b in self.buckets if b >= length)

    def _relayout(self, src: str, src_len: int, valid: int, dst: str, dst_len: int) -> Copy2D:
        return Copy2D(src, dst, 0, src_len * self.row_bytes, 0, dst_len * self.row_bytes,
                      valid * self.row_bytes, self.rows)

    def start(self, prompt_len: int) -> list[Op]:
        """The prefill wrote `prompt_len` positions contiguously into `b`."""
        self.past_len = prompt_len
        if not self.bucketed:
            if prompt_len > self.p_max:
                self.bucket_for(prompt_len)  # raises with the message
            self.past_buf = "b"
            return []
        self.bucket = self.bucket_for(prompt_len)
        self.past_buf = "a"
        return [self._relayout("b", prompt_len, prompt_len, "a", self.bucket),
                MaskFill(prompt_len, self.bucket)]

    def advance(self) -> list[Op]:
        """After a step wrote its present into `present_buf`: make it the next past."""
        new_len = self.past_len + 1
        if not self.bucketed:
            if new_len > self.p_max:
                self.bucket_for(new_len)
            self.past_buf = self.present_buf
            self.past_len = new_len
            return []
        pb = self.bucket
        if new_len <= pb:
            # Move the new position (present index pb) to past index P.
            op: list[Op] = [Copy2D("b", "a", pb * self.row_bytes, (pb + 1) * self.row_bytes,
                                   self.past_len * self.row_bytes, pb * self.row_bytes, self.row_bytes, self.rows),
                            MaskSet(self.past_len)]
            self.past_len = new_len
            return op
        # P == pb: the present is exactly the pb + 1 valid positions; lay it out
        # at the next bucket.
        nb = self.bucket_for(new_len)
        ops: list[Op] = [self._relayout("b", pb + 1, new_len, "a", nb), MaskFill(new_len, nb)]
        self.past_len, self.bucket = new_len, nb
        return ops


def apply_host(op: Op, buffers: dict[str, np.ndarray], mask: np.ndarray) -> None:
    """Execute one op on host byte buffers (uint8) and a host mask: the
    reference the device executor follows, used by the tests."""
    if isinstance(op, Copy2D):
        src, dst = buffers[op.src], buffers[op.dst]
        for r in range(op.height):
            s = op.src_offset + r * op.src_pitch
            d = op.dst_offset + r * op.dst_pitch
            dst[d:d + op.width] = src[s:s + op.width]
    elif isinstance(op, MaskSet):
        mask.reshape(-1)[op.index] = 1
    else:
        filled = bucket_mask(op.valid, op.bucket).reshape(-1)
        mask.reshape(-1)[:filled.size] = filled
