"""The streaming flow encoder's caches of one request
(edge_build/export/flow_encoder.py): K/V of both conformer stacks and the
two convolution histories. Where they live is chosen once per engine, as for
the estimator's (flow_cache.py): host arrays passed to the dynamic graph on
every call here (`HostEncoderCache`), device buffers replayed by a captured
fixed-shape graph in models/backends/ort_static_encoder.py."""

from __future__ import annotations

import abc
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
from cosyedge_models.backends.base import Session
from cosyedge_models.backends.fixed_shapes import SlotBorrower, bucket, prefix_fits, stays_fixed
from cosyedge_models.backends.flow_cache import HostKvBuffer, PrefixRows
from cosyedge_models.errors import BundleError

log = logging.getLogger(__name__)

ENCODER_DIMS = ("layers", "up_layers", "heads", "head_dim", "pre_channels", "pre_history", "upconv_channels",
                "upconv_history")


@dataclass(frozen=True)
class EncoderCacheSpec:
    """The encoder's cache dimensions (manifest `stages.flow_encoder.cache`), the bundle's
    streaming chunk (tokens) and the token-to-mel ratio (the up-sampling stride)."""

    dims: Mapping[str, int]
    chunk_tokens: int
    token_mel_ratio: int

    @classmethod
    def from_manifest(cls, entry: Mapping[str, object], chunk_tokens: int, token_mel_ratio: int) -> EncoderCacheSpec:
        raw = entry.get("cache")
        if not isinstance(raw, dict) or any(k not in raw for k in ENCODER_DIMS):
            raise BundleError("manifest: stages.flow_encoder has no cache dimensions; re-export the bundle "
                              "with this version's 'cosyedge build export'")
        return cls({k: int(raw[k]) for k in ENCODER_DIMS}, chunk_tokens, token_mel_ratio)

    @property
    def enc_row(self) -> tuple[int, ...]:
        """One token's K/V in the first stack: (layers, K|V, batch 1, heads, head_dim)."""
        return (self.dims["layers"], 2, 1, self.dims["heads"], self.dims["head_dim"])

    @property
    def up_row(self) -> tuple[int, ...]:
        """One up-sampled frame's K/V in the second stack."""
        return (self.dims["up_layers"], 2, 1, self.dims["heads"], self.dims["head_dim"])

    @property
    def pre_shape(self) -> tuple[int, ...]:
        return (1, self.dims["pre_channels"], self.dims["pre_history"])

    @property
    def upconv_shape(self) -> tuple[int, ...]:
        return (1, self.dims["upconv_channels"], self.dims["upconv_history"])


@dataclass(frozen=True)
class EncoderPrefix:
    """A voice's encoder state after its prompt's complete chunks (read-only): the K/V rows
    of both stacks (host, plus a copy per device made by its first request there) and the
    two conv histories."""

    enc: PrefixRows
    up: PrefixRows
    pre: np.ndarray
    upconv: np.ndarray

    @property
    def tokens(self) -> int:
        return self.enc.frames

    def nbytes(self) -> int:
        return self.enc.host.nbytes + self.up.host.nbytes + self.pre.nbytes + self.upconv.nbytes

    def device_nbytes(self) -> int:
        return self.enc.device_nbytes() + self.up.device_nbytes()

    def retire(self) -> None:
        self.enc.retire()
        self.up.retire()


class EncoderCache(Protocol):
    """One streaming request's encoder caches and the graph that reads them."""

    spec: EncoderCacheSpec

    @property
    def length(self) -> int:
        """Committed tokens held."""
        ...

    def encode(self, tokens: np.ndarray, embedding: np.ndarray, lookahead: int,
               commit: int) -> tuple[np.ndarray, np.ndarray]:
        """The encoder over `tokens` (those after the committed ones; the last `lookahead`
        are context only) with these caches before them: mu [1, C, frames] for all but the
        look-ahead tokens and spks [1, C]; the first `commit` tokens join the caches."""
        ...

    def preload(self, prefix: EncoderPrefix) -> None:
        """Start from a voice's saved state, before the first encode."""
        ...

    def nbytes(self) -> int:
        ...

    def close(self) -> None:
        """Release the buffers; the cache is unusable afterwards."""
        ...


def encoder_feeds(tokens: np.ndarray, embedding: np.ndarray, lookahead: int, chunk_tokens: int,
                  cache: HostEncoderCache | None, commit: int, spec: EncoderCacheSpec) -> dict[str, np.ndarray]:
    """The dynamic graph's inputs: one request, `cache` None for no history (offline)."""
    empty = np.zeros((0, *spec.enc_row), np.float32), np.zeros((0, *spec.up_row), np.float32)
    return {
        "token": tokens[None].astype(np.int64, copy=False),
        "token_len": np.array([tokens.shape[0]], dtype=np.int64),
        "lookahead_len": np.array([lookahead], dtype=np.int64),
        "chunk_tokens": np.array([chunk_tokens], dtype=np.int64),
        "embedding": embedding[None].astype(np.float32, copy=False),
        "enc_cache": cache.enc.kv if cache is not None else empty[0],
        "up_cache": cache.up.kv if cache is not None else empty[1],
        "pre_cache": cache.pre if cache is not None else np.zeros(spec.pre_shape, np.float32),
        "upconv_cache": cache.upconv if cache is not None else np.zeros(spec.upconv_shape, np.float32),
        "commit": np.zeros((commit if cache is not None else 0,), dtype=np.float32),
    }


class HostEncoderCache:
    """EncoderCache in host arrays over the dynamic graph: every call passes the cached K/V
    (the runtime copies it to its device, if it has one)."""

    def __init__(self, session: Session, spec: EncoderCacheSpec) -> None:
        self.spec = spec
        self._session = session
        self.enc = HostKvBuffer(spec.enc_row)
        self.up = HostKvBuffer(spec.up_row)
        self.pre = np.zeros(spec.pre_shape, dtype=np.float32)
        self.upconv = np.zeros(spec.upconv_shape, dtype=np.float32)

    @property
    def length(self) -> int:
        return self.enc.length

    def encode(self, tokens: np.ndarray, embedding: np.ndarray, lookahead: int,
               commit: int) -> tuple[np.ndarray, np.ndarray]:
        out = self._session.run(encoder_feeds(tokens, embedding, lookahead, self.spec.chunk_tokens, self, commit,
                                              self.spec))
        if commit:
            self.enc.append(out["enc_cache_new"])
            self.up.append(out["up_cache_new"])
            self.pre, self.upconv = out["pre_cache_new"], out["upconv_cache_new"]
        frames = self.spec.token_mel_ratio * (tokens.shape[0] - lookahead)
        return out["mu"][:, :, :frames], out["spks"]

    def preload(self, prefix: EncoderPrefix) -> None:
        if self.length:
            raise RuntimeError("preload() on an encoder cache that holds tokens")
        self.enc.append(prefix.enc.host)
        self.up.append(prefix.up.host)
        self.pre, self.upconv = prefix.pre.copy(), prefix.upconv.copy()

    def adopt(self, enc: np.ndarray, up: np.ndarray, pre: np.ndarray, upconv: np.ndarray) -> None:
        """Continue from state read back from elsewhere (a device slot that no longer fits)."""
        if self.length:
            raise RuntimeError("adopt() on an encoder cache that holds tokens")
        self.enc.append(enc)
        self.up.append(up)
        self.pre, self.upconv = pre, upconv

    def snapshot(self) -> EncoderPrefix:
        """What it holds, as a voice's saved prefix (copies)."""
        return EncoderPrefix(PrefixRows(self.enc.kv.copy()), PrefixRows(self.up.kv.copy()), self.pre.copy(),
                             self.upconv.copy())

    def nbytes(self) -> int:
        return self.enc.nbytes() + self.up.nbytes() + self.pre.nbytes + self.upconv.nbytes

    def close(self) -> None:
        self.enc.clear()
        self.up.clear()


# Where a streaming request's encoder caches live (the engine's choice).
EncoderCacheFactory = Callable[[Session, EncoderCacheSpec], EncoderCache]


def host_encoder_cache(session: Session, spec: EncoderCacheSpec) -> EncoderCache:
    return HostEncoderCache(session, spec)


@dataclass(frozen=True)
class EncoderCall:
    """One fixed-shape encoder call's host inputs, as the graph thread writes them."""

    window: int  # index of the window size
    tokens: np.ndarray
    embedding: np.ndarray
    lookahead: int
    cached: int  # committed tokens before the window (where the committed rows go)
    commit: int


class _HasNbytes(Protocol):
    def nbytes(self) -> int: ...


SlotC = TypeVar("SlotC", contravariant=True)
EncoderOut = tuple[np.ndarray, np.ndarray]  # mu, spks
EncSlotT = TypeVar("EncSlotT", bound=_HasNbytes)


class EncoderGraphs(Protocol[SlotC]):
    """What a pooled encoder cache needs of its runtime (ort_static_encoder, tensorrt/static_encoder)."""

    windows: list[int]
    cache_tokens: int
    disabled: str | None

    def release(self, slot: SlotC) -> None: ...

    def note_move(self) -> None: ...

    def replay(self, work: Callable[[], EncoderOut], what: str) -> EncoderOut | None: ...


class PooledEncoderCache(SlotBorrower[EncSlotT, HostEncoderCache], abc.ABC):
    """EncoderCache on a fixed-shape runtime's slot: the control flow both runtimes share
    (bucket, fit, replay on the graph thread, a move, once, to a HostEncoderCache over the
    dynamic graph when a call does not fit or a replay is refused); the runtime does the
    device work (`_replay` on the graph thread, `_read_back`, `_seed`, `_reset`)."""

    def __init__(self, graphs: EncoderGraphs[EncSlotT], slot: EncSlotT, dynamic: Session,
                 spec: EncoderCacheSpec) -> None:
        super().__init__(slot)
        self.spec = spec
        self._pool = graphs
        self._dynamic = dynamic

    @abc.abstractmethod
    def _replay(self, slot: EncSlotT, call: EncoderCall) -> tuple[np.ndarray, np.ndarray]:
        """On the graph thread: inputs in, replay, committed rows into the slot; mu and spks."""

    @abc.abstractmethod
    def _read_back(self, slot: EncSlotT, tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The first `tokens` committed rows of both stacks and both conv histories, as host arrays."""

    @abc.abstractmethod
    def _seed(self, slot: EncSlotT, prefix: EncoderPrefix) -> None:
        """A voice's prefix into the slot (rows by device copy from the voice's copy there)."""

    @abc.abstractmethod
    def _reset(self, slot: EncSlotT) -> None:
        """Zero the conv histories for the next borrower (free K/V rows are masked)."""

    def _move(self) -> HostEncoderCache:
        slot = self._slot
        assert slot is not None
        moved = HostEncoderCache(self._dynamic, self.spec)
        moved.adopt(*self._read_back(slot, self._length))
        self._release()
        self._moved = moved
        self._pool.note_move()
        log.debug("flow encoder cache: %d tokens moved to the dynamic graph", self._length)
        return moved

    def _release(self) -> None:
        slot = self._slot
        if slot is not None:
            self._reset(slot)
            self._pool.release(slot)
            self._slot = None

    def preload(self, prefix: EncoderPrefix) -> None:
        """A voice's prefix seeded into the slot; one that leaves no room for a window goes
        to the host caches."""
        if self._length or self._moved is not None:
            raise RuntimeError("preload() on an encoder cache that holds tokens")
        slot = self._slot
        if slot is None or not prefix_fits(prefix.tokens, self._pool.windows, self._pool.cache_tokens):
            self._move().preload(prefix)
            return
        self._seed(slot, prefix)
        self._length = prefix.tokens

    def encode(self, tokens: np.ndarray, embedding: np.ndarray, lookahead: int,
               commit: int) -> tuple[np.ndarray, np.ndarray]:
        if self._closed:
            raise RuntimeError("flow encoder cache used after close()")
        pool = self._pool
        w = bucket(pool.windows, tokens.shape[0])
        if self._moved is None and not stays_fixed(w, self._length, commit, pool.cache_tokens,
                                                   pool.disabled is not None):
            self._move()
        if self._moved is not None:
            return self._moved.encode(tokens, embedding, lookahead, commit)
        slot = self._slot
        assert slot is not None and w is not None
        call = EncoderCall(w, tokens, embedding, lookahead, self._length, commit)
        out = pool.replay(functools.partial(self._replay, slot, call), "fixed-shape flow encoder graphs")
        if out is None:
            return self._move().encode(tokens, embedding, lookahead, commit)  # nothing was committed
        self._length += commit
        return out

    def nbytes(self) -> int:
        if self._moved is not None:
            return self._moved.nbytes()
        return 0 if self._slot is None else self._slot.nbytes()

    def close(self) -> None:
        self._release()
        if self._moved is not None:
            self._moved.close()
            self._moved = None
        self._length = 0
        self._closed = True

