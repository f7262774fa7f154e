"""Speech tokens to mel: the flow encoder graph and the conditional flow
matching (CFM) Euler solver with classifier-free guidance over the estimator
graph, as upstream `CausalMaskedDiffWithXvec.inference` and
`CausalConditionalCFM` do it (fixed start noise, cosine time schedule).

Streaming (`FlowStream`) keeps, per Euler step, the estimator's caches of
the frames whose mask chunks are complete (edge_build/export/flow_estimator.py
explains why that is exact), so each chunk costs the estimator only its new
frames plus the unfinished mask chunk before them, instead of the whole
prefix as upstream's streaming does."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from models.backends.base import Session
from models.bundle import Bundle, FlowConfig
from models.errors import BundleError

log = logging.getLogger(__name__)

FinalChunk = Literal["upstream", "cached"]
FINAL_CHUNK_MODES: tuple[FinalChunk, ...] = ("upstream", "cached")
CFG_BATCH = 2  # conditional and unconditional rows


@dataclass(frozen=True)
class FlowPrompt:
    """The flow's conditioning from the voice: prompt speech tokens, their mel
    (2 frames per token) and the speaker embedding."""

    tokens: np.ndarray  # [Tp] int64
    feat: np.ndarray  # [2 * Tp, C] float32
    embedding: np.ndarray  # [E] float32


@dataclass(frozen=True)
class CacheDims:
    """The estimator's cache shapes (the manifest's stages.flow_estimator.cache)."""

    blocks: int  # transformer blocks: one K and one V per block and frame
    heads: int
    head_dim: int
    convs: int  # causal convolutions
    conv_channels: int  # their widest input
    conv_history: int  # kernel - 1 frames
    stream_cache: bool  # the estimator is chunk-causal (single-level U-Net)

    @classmethod
    def from_manifest(cls, entry: dict[str, Any]) -> CacheDims:
        raw = entry.get("cache")
        if not isinstance(raw, dict):
            raise BundleError("manifest: stages.flow_estimator has no cache dimensions; re-export the bundle "
                              "with this version's 'cosyedge build export'")
        try:
            return cls(blocks=int(raw["blocks"]), heads=int(raw["heads"]), head_dim=int(raw["head_dim"]),
                       convs=int(raw["convs"]), conv_channels=int(raw["conv_channels"]),
                       conv_history=int(raw["conv_history"]), stream_cache=bool(raw["stream_cache"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise BundleError(f"manifest: stages.flow_estimator.cache is incomplete ({exc}); re-export the bundle") \
                from exc


def cache_bytes_per_frame(dims: CacheDims, n_timesteps: int, itemsize: int = 4) -> int:
    """Streaming cache of one request per committed mel frame: K and V of
    every transformer block, for each Euler step and both CFG rows (itemsize
    2 for fp16 bundles, whose estimator takes the cache in fp16)."""
    return dims.blocks * n_timesteps * CFG_BATCH * 2 * dims.heads * dims.head_dim * itemsize


def stream_cache_bytes(dims: CacheDims, n_timesteps: int, frames: int, itemsize: int = 4) -> int:
    """The whole cache of a request at `frames` committed mel frames (the
    conv history is fixed-size and included)."""
    conv = n_timesteps * dims.convs * CFG_BATCH * dims.conv_channels * dims.conv_history * itemsize
    return frames * cache_bytes_per_frame(dims, n_timesteps, itemsize) + conv


def time_span(n_timesteps: int, scheduler: str) -> np.ndarray:
    t = np.linspace(0.0, 1.0, n_timesteps + 1, dtype=np.float32)
    if scheduler == "cosine":
        t = (1.0 - np.cos(t * np.float32(0.5 * np.pi))).astype(np.float32)
    return t


@dataclass
class EstimatorWork:
    """Deterministic cost count: estimator calls and the mel frames they
    evaluated (one Euler step of one window counts its frames once)."""

    calls: int = 0
    frames: int = 0


class _StepCache:
    """One Euler step's caches: a growing time-major K/V buffer (a prefix of it
    is passed without a copy) and the conv history."""

    def __init__(self, dims: CacheDims, visible: int = -1, dtype: np.dtype[Any] | None = None) -> None:
        self.dtype = np.dtype(np.float32) if dtype is None else dtype
        self._kv = np.zeros((0, dims.blocks, 2, CFG_BATCH, dims.heads, dims.head_dim), dtype=self.dtype)
        self.length = 0
        self.visible = visible  # -1: all committed frames; else only the last `visible`
        self.conv = np.zeros((dims.convs, CFG_BATCH, dims.conv_channels, dims.conv_history), dtype=np.float32)

    @property
    def kv(self) -> np.ndarray:
        first = 0 if self.visible < 0 else max(self.length - self.visible, 0)
        return self._kv[first: self.length]

    def trim(self, keep: int) -> None:
        """Drop all but the last `keep` frames once they take more than half the
        buffer (bounded left context): amortized, like the growth."""
        if self.length > max(2 * keep, 1) and self.length - keep >= self._kv.shape[0] // 2:
            self._kv[:keep] = self._kv[self.length - keep: self.length].copy()
            self.length = keep

    def append(self, new: np.ndarray) -> None:
        n = new.shape[0]
        if self.length + n > self._kv.shape[0]:
            grown = np.empty((max(2 * self._kv.shape[0], self.length + n), *self._kv.shape[1:]), dtype=self.dtype)
            grown[: self.length] = self._kv[: self.length]
            self._kv = grown
        self._kv[self.length: self.length + n] = new
        self.length += n

    def nbytes(self) -> int:
        return self._kv.nbytes + self.conv.nbytes


class FlowDecoder:
    def __init__(self, bundle: Bundle, encoder: Session, estimator: Session) -> None:
        self.config: FlowConfig = bundle.flow
        self.mel_bins = bundle.mel_bins
        self.token_mel_ratio = bundle.token_mel_ratio
        self.encoder = encoder
        self.estimator = estimator
        self.noise = np.asarray(bundle.array("flow_noise", mmap=False), dtype=np.float32)
        self.t_span = time_span(self.config.n_timesteps, self.config.t_scheduler)
        raw = bundle.stages["flow_estimator"].raw
        self.cache_dims = CacheDims.from_manifest(raw)
        # fp16 bundles: the graph takes and gives the K/V cache in fp16 (half the memory)
        self.cache_dtype = np.dtype(np.float16 if "att_cache" in raw.get("fp16_io", ()) else np.float32)
        self._empty = _StepCache(self.cache_dims, dtype=self.cache_dtype)  # offline calls: no history

    def encode(self, tokens: np.ndarray, embedding: np.ndarray, lookahead: int, chunk_tokens: int) -> tuple[
            np.ndarray, np.ndarray]:
        """mu [1, C, frames] for all but the look-ahead tokens, spks [1, C]."""
        n = tokens.shape[0]
        out = self.encoder.run({
            "token": tokens[None].astype(np.int64, copy=False),
            "token_len": np.array([n], dtype=np.int64),
            "lookahead_len": np.array([lookahead], dtype=np.int64),
            "chunk_tokens": np.array([chunk_tokens], dtype=np.int64),
            "embedding": embedding[None].astype(np.float32, copy=False),
        })
        frames = self.token_mel_ratio * (n - lookahead)
        return out["mu"][:, :, :frames], out["spks"]

    def euler(self, mu: np.ndarray, spks: np.ndarray, cond: np.ndarray, start: int, chunk_frames: int,
              caches: list[_StepCache] | None = None, commit: int = 0,
              work: EstimatorWork | None = None) -> np.ndarray:
        """Euler steps from the fixed noise over the window of frames
        [start, start + mu.shape[2]) (mu, cond [1, C, window]); with `caches`
        (one per step) the frames before `start` come from them, and the
        window's first `commit` frames are appended to them. Returns x [1, C, window]."""
        frames = mu.shape[2]
        end = start + frames
        if end > self.noise.shape[1]:
            raise ValueError(f"{end} mel frames exceed the flow noise table ({self.noise.shape[1]})")
        c = self.mel_bins
        x = self.noise[None, :, start:end].copy()
        # Conditional row 0, unconditional row 1 (zeros), as upstream's solve_euler.
        mask_in = np.ones((CFG_BATCH, 1, frames), dtype=np.float32)
        mu_in = np.zeros((CFG_BATCH, c, frames), dtype=np.float32)
        mu_in[0] = mu[0]
        spks_in = np.zeros((CFG_BATCH, c), dtype=np.float32)
        spks_in[0] = spks[0]
        cond_in = np.zeros((CFG_BATCH, c, frames), dtype=np.float32)
        cond_in[0] = cond[0]
        chunk_in = np.full((CFG_BATCH,), chunk_frames, dtype=np.int64)
        commit_in = np.zeros((commit,), dtype=np.float32)  # only its length is read
        rate = np.float32(self.config.inference_cfg_rate)
        t_span = self.t_span
        t = t_span[0]
        dt = t_span[1] - t_span[0]
        for step in range(1, len(t_span)):
            cache = caches[step - 1] if caches is not None else self._empty
            x_in = np.concatenate([x, x], axis=0)
            t_in = np.full((CFG_BATCH,), t, dtype=np.float32)
            out = self.estimator.run({
                "x": x_in, "mask": mask_in, "mu": mu_in, "t": t_in, "spks": spks_in,
                "cond": cond_in, "chunk_frames": chunk_in, "att_cache": cache.kv, "conv_cache": cache.conv,
                "commit": commit_in,
            })
            if caches is not None and commit:
                cache.append(out["att_cache_new"])
                cache.conv = out["conv_cache_new"]
            if work is not None:
                work.calls += 1
                work.frames += frames
            d = out["dphi_dt"]
            guided = (np.float32(1.0) + rate) * d[:1] - rate * d[1:]
            x = (x + dt * guided).astype(np.float32, copy=False)
            t = np.float32(t + dt)
            if step < len(t_span) - 1:
                dt = np.float32(t_span[step + 1] - t)
        return x

    def cond_window(self, prompt_feat: np.ndarray, start: int, end: int) -> np.ndarray:
        """The prompt mel as the CFM's condition for frames [start, end) (zeros after the prompt)."""
        cond = np.zeros((1, self.mel_bins, end - start), dtype=np.float32)
        n = min(prompt_feat.shape[0], end)
        if n > start:
            cond[0, :, : n - start] = prompt_feat[start:n].T
        return cond

    def solve(self, mu: np.ndarray, spks: np.ndarray, prompt_feat: np.ndarray, chunk_frames: int,
              work: EstimatorWork | None = None) -> np.ndarray:
        """Euler steps from the fixed noise; returns the mel of all frames
        (prompt included) [1, C, frames]."""
        cond = self.cond_window(prompt_feat, 0, mu.shape[2])
        return self.euler(mu, spks, cond, 0, chunk_frames, work=work)

    def mel(self, tokens: np.ndarray, prompt: FlowPrompt, finalize: bool, streaming: bool,
            work: EstimatorWork | None = None) -> np.ndarray:
        """Mel frames [1, C, frames] for `tokens` (prompt excluded), as upstream
        `flow.inference(..., streaming, finalize)`."""
        all_tokens = np.concatenate([prompt.tokens.astype(np.int64), tokens.astype(np.int64)])
        lookahead = 0 if finalize else self.config.pre_lookahead_len
        chunk = self.config.chunk_tokens if streaming else 0
        mu, spks = self.encode(all_tokens, prompt.embedding, lookahead, chunk)
        feat = self.solve(mu, spks, prompt.feat, chunk * self.token_mel_ratio, work=work)
        return feat[:, :, prompt.feat.shape[0]:]

    def stream(self, prompt: FlowPrompt, final_chunk: FinalChunk = "upstream", left_chunks: int = -1) -> FlowStream:
        return FlowStream(self, prompt, final_chunk, left_chunks)


class FlowStream:
    """One streaming request's flow: `push(tokens)` with the growing token
    prefix (look-ahead included) returns the mel frames not returned before,
    equal to upstream's full-prefix streaming pass over those frames; `finish`
    returns the rest once all tokens are known.

    The flow ENCODER still runs over the whole token prefix each call (not
    cached): one encoder pass costs ~1.3-2% of the offline estimator (its
    n_timesteps x CFG-batch passes) at full size, so its prefix re-runs add
    ~9% of the offline flow cost for a 20 s utterance (measured, torch CPU);
    the estimator, which dominates, only evaluates the window from the last
    complete mask chunk on. On the tiny test model the 512-wide encoder is
    ~40% of the flow and its re-runs dominate the streaming overhead.

    Where the commit point goes: the graph takes it (the `commit` input's
    length), so it slices the conv histories at the right frame itself; the
    runtime picks it as the end of the window's last complete mask chunk."""

    def __init__(self, decoder: FlowDecoder, prompt: FlowPrompt, final_chunk: FinalChunk = "upstream",
                 left_chunks: int = -1) -> None:
        if final_chunk not in FINAL_CHUNK_MODES:
            raise ValueError(f"final_chunk must be one of {', '.join(FINAL_CHUNK_MODES)}, got {final_chunk!r}")
        if left_chunks < -1:
            raise ValueError(f"left_chunks must be -1 (full left context) or >= 0, got {left_chunks}")
        self.decoder = decoder
        self.prompt = prompt
        self.final_chunk = final_chunk
        cfg = decoder.config
        self.chunk_frames = cfg.chunk_tokens * decoder.token_mel_ratio
        self.prompt_frames = prompt.feat.shape[0]
        self.emitted = self.prompt_frames  # frames (prompt included) returned so far
        self.committed = 0  # frames whose estimator state is in the caches
        # Multi-level U-Nets (not CosyVoice 2's) are not chunk-causal: recompute the prefix as upstream.
        self.cached = decoder.cache_dims.stream_cache and self.chunk_frames > 0
        # left_chunks -1: every committed frame stays visible (exact). >= 0: only
        # the last left_chunks mask chunks of the cache are kept and attended to
        # (plus the window's own earlier chunk, if it has one): bounded memory for
        # long utterances, but the mel then differs from upstream's.
        self.left_chunks = left_chunks
        visible = -1 if left_chunks < 0 else left_chunks * self.chunk_frames
        self.caches = ([_StepCache(decoder.cache_dims, visible, decoder.cache_dtype) for _ in range(cfg.n_timesteps)]
                       if self.cached else [])
        self.work = EstimatorWork()
        self._tokens = prompt.tokens.astype(np.int64)

    def cache_bytes(self) -> int:
        return sum(c.nbytes() for c in self.caches)

    def _window(self, tokens: np.ndarray, finalize: bool) -> np.ndarray:
        dec = self.decoder
        all_tokens = np.concatenate([self._tokens, np.asarray(tokens, dtype=np.int64)])
        lookahead = 0 if finalize else dec.config.pre_lookahead_len
        mu, spks = dec.encode(all_tokens, self.prompt.embedding, lookahead, dec.config.chunk_tokens)
        end = mu.shape[2]
        start = self.committed
        if end < self.emitted:
            raise ValueError(f"the token prefix shrank: {end} mel frames, {self.emitted} already returned")
        # Frames in complete mask chunks are final: commit them (not at the
        # last call, whose caches are never read again).
        commit = 0 if finalize else (end - start) // self.chunk_frames * self.chunk_frames
        cond = dec.cond_window(self.prompt.feat, start, end)
        x = dec.euler(mu[:, :, start:], spks, cond, start, self.chunk_frames, self.caches, commit, self.work)
        self.committed += commit
        for cache in self.caches:
            if cache.visible >= 0:
                cache.trim(cache.visible)
        out = x[:, :, self.emitted - start:]
        self.emitted = end
        return out

    def push(self, tokens: np.ndarray) -> np.ndarray:
        """New mel frames [1, C, n] for the token prefix `tokens` (prompt
        excluded, the look-ahead tokens at its end are context only)."""
        if not self.cached:
            mel = self.decoder.mel(np.asarray(tokens), self.prompt, finalize=False, streaming=True, work=self.work)
            out = mel[:, :, self.emitted - self.prompt_frames:]
            self.emitted = self.prompt_frames + mel.shape[2]
            return out
        return self._window(tokens, finalize=False)

    def finish(self, tokens: np.ndarray) -> np.ndarray:
        """The remaining mel frames once all `tokens` are known. "upstream":
        upstream's final non-streaming pass over everything (full attention;
        costs a full-length estimator pass); "cached": the last window through
        the caches with the chunk mask (linear cost; its frames differ a little
        from upstream's)."""
        if self.final_chunk == "upstream" or not self.cached:
            mel = self.decoder.mel(np.asarray(tokens), self.prompt, finalize=True, streaming=False, work=self.work)
            out = mel[:, :, self.emitted - self.prompt_frames:]
            self.emitted = self.prompt_frames + mel.shape[2]
        else:
            out = self._window(tokens, finalize=True)
        log.debug("flow stream: %d mel frames, estimator %d calls over %d frames, caches %.1f MiB",
                  self.emitted, self.work.calls, self.work.frames, self.cache_bytes() / (1 << 20))
        return out
