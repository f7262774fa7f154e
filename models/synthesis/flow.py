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

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from cosyedge_models.backends.base import Session
from cosyedge_models.backends.encoder_cache import (
    EncoderCache,
    EncoderCacheFactory,
    EncoderCacheSpec,
    encoder_feeds,
    host_encoder_cache,
)
from cosyedge_models.backends.flow_cache import HostStepCache, StepCache, StepCacheSpec
from cosyedge_models.bundle.loader import Bundle, FlowConfig
from cosyedge_models.errors import BundleError

if TYPE_CHECKING:
    from cosyedge_models.batching.seats import StreamSeats
    from cosyedge_models.synthesis.flow_gather import FlowGather
    from cosyedge_models.synthesis.voice_cache import FlowPrefix

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


def step_grid(n_timesteps: int, steps: int | None) -> list[int]:
    """Indices into the bundle's time grid (n_timesteps + 1 points) of an Euler
    pass of `steps` steps: every point (None or n_timesteps), else an evenly
    spread subset from 0 to n_timesteps. Its steps start at the bundle's own
    times, so each still reads the cache of the bundle step that starts there
    (a voice prefix's rows, the K/V of earlier frames)."""
    if steps is None or steps == n_timesteps:
        return list(range(n_timesteps + 1))
    if not 1 <= steps <= n_timesteps:
        raise ValueError(f"first_chunk_euler_steps must be between 1 and the bundle's n_timesteps "
                         f"({n_timesteps}), got {steps}")
    return [(2 * j * n_timesteps + steps) // (2 * steps) for j in range(steps + 1)]


def time_span(n_timesteps: int, scheduler: str) -> np.ndarray:
    t = np.linspace(0.0, 1.0, n_timesteps + 1, dtype=np.float32)
    if scheduler == "cosine":
        t = (1.0 - np.cos(t * np.float32(0.5 * np.pi))).astype(np.float32)
    return t


@dataclass
class EstimatorWork:
    """Deterministic cost count: estimator calls and the mel frames they
    evaluated (one Euler step of one window counts its frames once), and the
    tokens the encoder ran over."""

    calls: int = 0
    frames: int = 0
    encoder_tokens: int = 0


def prompt_commit_frames(decoder: FlowDecoder, prompt_tokens: int) -> int:
    """Mel frames of the prompt's complete chunks whose look-ahead tokens are
    in the prompt too: the same for every request with that prompt (0: none)."""
    cfg = decoder.config
    if not decoder.cache_dims.stream_cache or cfg.chunk_tokens <= 0:
        return 0
    main = max(prompt_tokens - cfg.pre_lookahead_len, 0)
    return main // cfg.chunk_tokens * cfg.chunk_tokens * decoder.token_mel_ratio


def commit_prompt(decoder: FlowDecoder, prompt: FlowPrompt, encoder: EncoderCache, caches: Sequence[StepCache],
                  work: EstimatorWork | None = None) -> int:
    """Run the prompt's complete chunks (tokens up to the commit point plus
    their look-ahead) into empty caches; returns the frames committed. Chunk-
    causal: the rows equal those a window over the prompt and any later
    tokens commits (up to summation order). models/synthesis/voice_cache.py keeps them."""
    cfg = decoder.config
    commit = prompt_commit_frames(decoder, prompt.tokens.size)
    if commit == 0:
        return 0
    commit_tokens = commit // decoder.token_mel_ratio
    lookahead = cfg.pre_lookahead_len
    tokens = prompt.tokens[: commit_tokens + lookahead].astype(np.int64)
    mu, spks = decoder.encode(tokens, prompt.embedding, lookahead, cfg.chunk_tokens, encoder, commit_tokens, work)
    cond = decoder.cond_window(prompt.feat, 0, commit)
    decoder.euler(mu[:, :, :commit], spks, cond, 0, cfg.chunk_tokens * decoder.token_mel_ratio, list(caches), commit,
                  work)
    return commit


def encoder_spec(bundle: Bundle) -> EncoderCacheSpec:
    """The shapes of a streaming request's encoder caches in this bundle."""
    return EncoderCacheSpec.from_manifest(bundle.stages["flow_encoder"].raw, bundle.flow.chunk_tokens,
                                          bundle.token_mel_ratio)


# Backend.flow_cache: where a streaming request's step caches live.
CacheFactory = Callable[[Session, StepCacheSpec], StepCache]


class FlowDecoder:
    def __init__(self, bundle: Bundle, encoder: Session, estimator: Session,
                 cache_factory: CacheFactory = HostStepCache,
                 encoder_cache_factory: EncoderCacheFactory = host_encoder_cache,
                 seats: StreamSeats | None = None, gather: FlowGather | None = None) -> None:
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
        self.cache_factory = cache_factory
        self.encoder_spec = encoder_spec(bundle)
        self.encoder_cache_factory = encoder_cache_factory
        # with the batched lanes: a streaming request takes a seat before its caches (models/batching/seats.py)
        self.seats = seats
        self.gather = gather  # later chunks' first estimator steps held together (graph_flow_gather_ms)

    def cache_spec(self, visible: int = -1, initial_frames: int = 0) -> StepCacheSpec:
        d = self.cache_dims
        return StepCacheSpec(row=(d.blocks, 2, CFG_BATCH, d.heads, d.head_dim),
                             conv=(d.convs, CFG_BATCH, d.conv_channels, d.conv_history), dtype=self.cache_dtype,
                             visible=visible, initial_frames=initial_frames)

    def empty_cache(self) -> HostStepCache:
        """An offline call's caches: no history (zero rows, zero conv history)."""
        return HostStepCache(self.estimator, self.cache_spec())

    def new_encoder_cache(self) -> EncoderCache:
        """A streaming request's encoder caches, where the engine keeps them."""
        return self.encoder_cache_factory(self.encoder, self.encoder_spec)

    def encode(self, tokens: np.ndarray, embedding: np.ndarray, lookahead: int, chunk_tokens: int,
               cache: EncoderCache | None = None, commit: int = 0,
               work: EstimatorWork | None = None) -> tuple[np.ndarray, np.ndarray]:
        """mu [1, C, frames] for all but the look-ahead tokens, spks [1, C].
        With `cache` (streaming, the bundle's chunk), `tokens` are those after the
        cached ones, and the first `commit` of them are added to it."""
        n = tokens.shape[0]
        if work is not None:
            work.encoder_tokens += n
        if cache is not None:
            if chunk_tokens != cache.spec.chunk_tokens:
                raise ValueError(f"a cached encoder call runs the bundle's chunk of {cache.spec.chunk_tokens} "
                                 f"tokens, not {chunk_tokens}")
            return cache.encode(tokens, embedding, lookahead, commit)
        out = self.encoder.run(encoder_feeds(tokens, embedding, lookahead, chunk_tokens, None, 0, self.encoder_spec))
        frames = self.token_mel_ratio * (n - lookahead)
        return out["mu"][:, :, :frames], out["spks"]

    def euler(self, mu: np.ndarray, spks: np.ndarray, cond: np.ndarray, start: int, chunk_frames: int,
              caches: list[StepCache] | None = None, commit: int = 0,
              work: EstimatorWork | None = None, grid: Sequence[int] | None = None) -> np.ndarray:
        """Euler steps from the fixed noise over the window of frames
        [start, start + mu.shape[2]) (mu, cond [1, C, window]); with `caches`
        (one per step) the frames before `start` come from them, and the
        window's first `commit` frames are appended to them. `grid` (step_grid):
        fewer steps, at those points of the time grid, reading (never writing:
        commit must be 0) the caches of the steps starting there. Returns x [1, C, window]."""
        if grid is not None and caches is not None and commit and len(grid) != len(self.t_span):
            raise ValueError("an Euler pass with fewer steps cannot commit to the caches")
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
        points = list(range(len(self.t_span))) if grid is None else list(grid)
        t_span = self.t_span[points]
        t = t_span[0]
        dt = t_span[1] - t_span[0]
        empty = self.empty_cache()  # offline calls: no history
        for step in range(1, len(t_span)):
            cache = caches[points[step - 1]] if caches is not None else empty
            x_in = np.concatenate([x, x], axis=0)
            t_in = np.full((CFG_BATCH,), t, dtype=np.float32)
            d = cache.run({"x": x_in, "mask": mask_in, "mu": mu_in, "t": t_in, "spks": spks_in, "cond": cond_in,
                           "chunk_frames": chunk_in, "commit": commit_in}, commit if caches is not None else 0)
            if work is not None:
                work.calls += 1
                work.frames += frames
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
        mu, spks = self.encode(all_tokens, prompt.embedding, lookahead, chunk, work=work)
        feat = self.solve(mu, spks, prompt.feat, chunk * self.token_mel_ratio, work=work)
        return feat[:, :, prompt.feat.shape[0]:]

    def stream(self, prompt: FlowPrompt, final_chunk: FinalChunk = "upstream", left_chunks: int = -1,
               prefix: FlowPrefix | None = None, first_steps: int | None = None) -> FlowStream:
        return FlowStream(self, prompt, final_chunk, left_chunks, prefix, first_steps)


class FlowStream:
    """One streaming request's flow: `push(tokens)` with the growing token
    prefix (look-ahead included) returns the mel frames not returned before,
    equal to upstream's full-prefix streaming pass over those frames; `finish`
    returns the rest once all tokens are known.

    Both flow graphs keep caches: the encoder (EncoderCache) and, per Euler
    step, the estimator, so each call evaluates only the window from the last
    complete chunk on. (Re-running the encoder over the whole prefix instead
    would add ~9% of the offline flow cost for a 20 s utterance at full size,
    where one encoder pass is ~1.3-2% of the offline estimator; on the tiny
    test model, whose encoder is 512 wide, it would dominate.)

    Where the commit point goes: the graphs take it (the `commit` input's
    length), so they slice the conv histories at the right frame themselves;
    the runtime picks it as the end of the window's last complete chunk.

    `prefix` (models/synthesis/voice_cache.py): the caches of the prompt's complete
    chunks, computed once per voice; the stream then starts after them.
    `prime()` computes the same into this stream's own caches, so a voice
    served with and without its cache gives the same mel, bit for bit.

    `first_steps` (fewer than the bundle's n_timesteps: sooner first audio): the
    first returned chunk runs that many Euler steps (step_grid) and commits
    nothing; the next call first runs the bundle's steps over that chunk's
    committed frames (its encoder output is kept) to fill every step's cache,
    so from the second chunk on the mel is the default's (up to summation
    order). The fill costs one full chunk pass, after the first audio is out.
    Streams without caches (not chunk-causal estimators) ignore it."""

    def __init__(self, decoder: FlowDecoder, prompt: FlowPrompt, final_chunk: FinalChunk = "upstream",
                 left_chunks: int = -1, prefix: FlowPrefix | None = None, first_steps: int | None = None) -> None:
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
        self.hold_s = 0.0  # the next window's hold before its estimator steps (decoder.gather; set per chunk)
        # Multi-level U-Nets (not CosyVoice 2's) are not chunk-causal: recompute the prefix as upstream.
        self.cached = decoder.cache_dims.stream_cache and self.chunk_frames > 0
        # left_chunks -1: every committed frame stays visible (exact). >= 0: only
        # the last left_chunks mask chunks of the cache are kept and attended to
        # (plus the window's own earlier chunk, if it has one): bounded memory for
        # long utterances, but the mel then differs from upstream's.
        self.left_chunks = left_chunks
        visible = -1 if left_chunks < 0 else left_chunks * self.chunk_frames
        # Device stores preallocate: the prompt and two chunks, then doubling.
        spec = decoder.cache_spec(visible, self.prompt_frames + 2 * self.chunk_frames)
        self.caches: list[StepCache] = []
        self.encoder_cache: EncoderCache | None = None
        # a seat first (waiting while every lane and slot is taken), released by close()
        self._seated = self.cached and decoder.seats is not None and decoder.seats.take()
        try:
            if self.cached:
                self.caches = [decoder.cache_factory(decoder.estimator, dataclasses.replace(spec, euler_step=k))
                               for k in range(cfg.n_timesteps)]
            self.encoder_cache = decoder.new_encoder_cache() if self.cached else None
            if prefix is not None:
                if not self.cached or left_chunks >= 0:
                    raise ValueError("a voice prefix needs the cached stream with the full left context")
                self.encoder_cache = prefix.apply(self.caches, self.encoder_cache)
                self.committed = prefix.committed
        except BaseException:
            self.close()
            raise
        self.work = EstimatorWork()
        grid = step_grid(cfg.n_timesteps, first_steps)
        # The first window's fewer steps, until it has run; then what its caches still need.
        self._first_grid: list[int] | None = grid if self.cached and len(grid) < cfg.n_timesteps + 1 else None
        self._unfilled: tuple[np.ndarray, np.ndarray, np.ndarray, int, int] | None = None
        self._tokens = prompt.tokens.astype(np.int64)
        self._closed = False

    def prime(self) -> np.ndarray:
        """Commit the prompt's complete chunks before the first push (what a
        voice prefix holds); only for a fresh cached stream with the full left
        context. Returns the new frames, as push does: none (prompt frames are not returned)."""
        self._check_open()
        if not self.cached or self.left_chunks >= 0 or self.committed or self.encoder_cache is None:
            raise ValueError("prime() needs a fresh cached stream with the full left context")
        self.committed = commit_prompt(self.decoder, self.prompt, self.encoder_cache, self.caches, self.work)
        return np.zeros((1, self.decoder.mel_bins, 0), dtype=np.float32)

    def cache_bytes(self) -> int:
        enc = self.encoder_cache.nbytes() if self.encoder_cache is not None else 0
        return sum(c.nbytes() for c in self.caches) + enc

    def close(self) -> None:
        """Release the caches (device memory with a device store) and the seat; idempotent."""
        for cache in self.caches:
            cache.close()
        self.caches = []
        if self.encoder_cache is not None:
            self.encoder_cache.close()
        self.encoder_cache = None
        if self._seated and self.decoder.seats is not None:
            self._seated = False
            self.decoder.seats.give_back()
        self._closed = True

    def __enter__(self) -> FlowStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fill(self) -> None:
        """The caches the fewer-step first chunk left unwritten: the bundle's
        Euler steps over its committed frames (the mel is not used)."""
        if self._unfilled is None:
            return
        mu, spks, cond, start, commit = self._unfilled
        self._unfilled = None
        self.decoder.euler(mu, spks, cond, start, self.chunk_frames, self.caches, commit, self.work)
        self.committed += commit
        for cache in self.caches:
            cache.trim()

    def _window(self, tokens: np.ndarray, finalize: bool) -> np.ndarray:
        dec = self.decoder
        cfg = dec.config
        self._fill()
        all_tokens = np.concatenate([self._tokens, np.asarray(tokens, dtype=np.int64)])
        lookahead = 0 if finalize else cfg.pre_lookahead_len
        # The encoder's chunks (chunk_tokens) and the estimator's (chunk_frames)
        # end on the same frames, so both commit up to the same point: the end of
        # the window's last complete chunk (nothing at the last call, whose
        # caches are never read again).
        start = self.committed
        window = all_tokens[start // dec.token_mel_ratio:]
        main = window.shape[0] - lookahead
        commit_tokens = 0 if finalize else main // cfg.chunk_tokens * cfg.chunk_tokens
        mu, spks = dec.encode(window, self.prompt.embedding, lookahead, cfg.chunk_tokens, self.encoder_cache,
                              commit_tokens, self.work)
        end = start + mu.shape[2]
        if end < self.emitted:
            raise ValueError(f"the token prefix shrank: {end} mel frames, {self.emitted} already returned")
        commit = commit_tokens * dec.token_mel_ratio
        cond = dec.cond_window(self.prompt.feat, start, end)
        grid, self._first_grid = self._first_grid, None
        if grid is not None:
            x = dec.euler(mu, spks, cond, start, self.chunk_frames, self.caches, 0, self.work, grid)
            if commit:  # committed by the next call, before its window (start stays here until then)
                self._unfilled = (mu[:, :, :commit], spks, cond[:, :, :commit], start, commit)
            out = x[:, :, self.emitted - start:]
            self.emitted = end
            return out
        if dec.gather is not None and self.hold_s > 0:  # after the encoder: the steps start with the others'
            dec.gather.hold(self.hold_s)
            self.hold_s = 0.0  # once: the synthesizer sets it again before each chunk
        x = dec.euler(mu, spks, cond, start, self.chunk_frames, self.caches, commit, self.work)
        self.committed += commit
        for cache in self.caches:
            cache.trim()
        out = x[:, :, self.emitted - start:]
        self.emitted = end
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("flow stream used after close()")

    def push(self, tokens: np.ndarray) -> np.ndarray:
        """New mel frames [1, C, n] for the token prefix `tokens` (prompt
        excluded, the look-ahead tokens at its end are context only)."""
        self._check_open()
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
        self._check_open()
        if self.final_chunk == "upstream" or not self.cached:
            mel = self.decoder.mel(np.asarray(tokens), self.prompt, finalize=True, streaming=False, work=self.work)
            out = mel[:, :, self.emitted - self.prompt_frames:]
            self.emitted = self.prompt_frames + mel.shape[2]
        else:
            out = self._window(tokens, finalize=True)
        log.debug("flow stream: %d mel frames, estimator %d calls over %d frames, caches %.1f MiB",
                  self.emitted, self.work.calls, self.work.frames, self.cache_bytes() / (1 << 20))
        return out
