"""The speech-token language model: prefill and step-by-step decode over the
`llm_prefill` / `llm_decode` graphs with a KV cache, and the decoding rules of
upstream `Qwen2LM.inference` (input layout, minimum and maximum length
relative to the text, EOS masking until the minimum, fill tokens skipped)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from cosyedge_models.backends.base import Backend, DecodeLoop, FixedSizeDecode, Session
from cosyedge_models.bundle.loader import Bundle, LlmConfig
from cosyedge_models.errors import SynthesisError
from cosyedge_models.synthesis.llm_prefix import LlmPrefix, build_llm_prefix
from cosyedge_models.synthesis.sampling import TokenSampler, sample_rows


@dataclass(frozen=True)
class LlmInput:
    """What the LLM is conditioned on for one text segment."""

    text: Sequence[int]  # token ids of the text to speak
    prompt_text: Sequence[int] = ()  # zero_shot transcript or instruct text ids
    prompt_speech: Sequence[int] = ()  # zero_shot prompt speech tokens
    # The saved voice's cached sos + prompt_text (models/synthesis/llm_prefix.py): the
    # prefill then runs only the rest. None: the whole prompt (the same tokens).
    prefix: LlmPrefix | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.prefix is not None and not self.prefix.matches(self.prompt_text):
            raise ValueError("LlmInput: the prefix was built from another prompt text")

    def length_limits(self, config: LlmConfig) -> tuple[int, int]:
        """(min_len, max_len) in speech tokens, as upstream: ratios of the text
        tokens without the prompt text."""
        n = len(self.text)
        return int(n * config.min_token_text_ratio), int(n * config.max_token_text_ratio)


@dataclass
class LlmStats:
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    steps: int = 0
    tokens: list[int] = field(default_factory=list)
    prefix_positions: int = 0  # prompt positions taken from a saved LLM prefix (not prefilled again)
    batch_max: int = 0  # the most requests in one batched decode step this request took part in (0: unbatched)


class SpeechTokenLM:
    """Owns the embedding tables and the two LLM sessions. One instance per
    worker thread (sessions are used from the thread that owns them)."""

    def __init__(self, bundle: Bundle, backend: Backend, prefill: Session, decode: Session) -> None:
        self.config = bundle.llm
        self.backend = backend
        self.prefill_session = prefill
        self.decode_session = decode
        # Memory-mapped: only the rows of tokens actually used are paged in.
        self.text_embedding = bundle.array("text_embedding")
        self.speech_embedding = np.asarray(bundle.array("speech_embedding", mmap=False), dtype=np.float32)
        special = np.asarray(bundle.array("special_embedding", mmap=False), dtype=np.float32)
        self.sos_eos = special[0]
        self.task_id = special[1]
        # Set by the engine where the bundle has the static step (CUDA graphs on ort-cuda).
        self.fixed_size_decode: FixedSizeDecode | None = None
        # llm_decode takes T new positions: a prefill can start from a voice's saved prefix.
        self.takes_prefix = bundle.llm_decode_positions

    def build_prefix(self, prompt_text: Sequence[int]) -> LlmPrefix:
        """The KV cache of sos + `prompt_text` (a saved voice's transcript), once per voice."""
        return build_llm_prefix(self.prefill_session, self.sos_eos, self.text_embedding, prompt_text)

    def prompt_embeds(self, inp: LlmInput) -> np.ndarray:
        """[1, T, D]: sos_eos, text embeddings of prompt text + text, task_id,
        speech embeddings of the prompt speech tokens."""
        ids = np.asarray(list(inp.prompt_text) + list(inp.text), dtype=np.int64)
        text = np.asarray(self.text_embedding[ids], dtype=np.float32)
        speech = self.speech_embedding[np.asarray(inp.prompt_speech, dtype=np.int64)]
        parts = [self.sos_eos[None], text, self.task_id[None], speech.reshape(-1, self.config.hidden_size)]
        return np.concatenate(parts, axis=0)[None].astype(np.float32, copy=False)

    def decode_loop(self, positions: int | None = None) -> DecodeLoop:
        """A request's loop; with its most positions (prompt + speech tokens)
        known, the fixed-size (CUDA graph) loop when it fits and one is free."""
        if positions is not None and self.fixed_size_decode is not None:
            loop = self.fixed_size_decode.loop(positions)
            if loop is not None:
                return loop
        return self.backend.decode_loop(self.prefill_session, self.decode_session)

    def start(self, inp: LlmInput, sampler: TokenSampler, stats: LlmStats | None = None) -> RequestDecode:
        """The per-request decoding state; both the unbatched loop below and
        the batcher (models/batching/llm_batcher.py) drive it, so the rules live once."""
        return RequestDecode(self, inp, sampler, stats if stats is not None else LlmStats())

    def generate(self, inp: LlmInput, sampler: TokenSampler, stats: LlmStats | None = None) -> Iterator[int]:
        """Yield speech tokens one by one until EOS or the maximum length."""
        req = self.start(inp, sampler, stats)
        loop = self.decode_loop(req.prompt.shape[1] + req.max_len)
        try:
            t0 = time.perf_counter()
            embeds, past = req.prefill_inputs(loop.takes_past)
            logp = loop.prefill(embeds, past)
            req.stats.prefill_ms += (time.perf_counter() - t0) * 1e3
            while not req.finished:
                token = req.accept(logp[0])
                if token is not None:
                    yield token
                if req.finished:
                    break
                t0 = time.perf_counter()
                logp = loop.step(req.next_input[None, None])
                req.stats.decode_ms += (time.perf_counter() - t0) * 1e3
        finally:
            loop.close()


class RequestDecode:
    """One request's decoding rules, independent of how its logits were
    computed (alone or as a row of a batch): minimum and maximum length,
    EOS masked until the minimum, fill tokens skipped, its own sampler and
    token list (upstream's repetition window), and the next step's input."""

    def __init__(self, lm: SpeechTokenLM, inp: LlmInput, sampler: TokenSampler, stats: LlmStats) -> None:
        self.min_len, self.max_len = inp.length_limits(lm.config)
        self.eos = lm.config.eos_token
        self.sampler = sampler
        self.stats = stats
        self.prompt = lm.prompt_embeds(inp)  # [1, T, D]
        self.prefix = inp.prefix if lm.takes_prefix else None
        self._speech_embedding = lm.speech_embedding
        self.next_input: np.ndarray = self.prompt[0, -1]  # [D]
        self.index = 0  # sampling steps taken
        self.finished = self.max_len <= 0

    def prefill_inputs(self, takes_past: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """(embeddings to prefill, saved past or None): the prompt after the
        voice's cached prefix where there is one and the loop `takes_past`,
        else the whole prompt. Counts the positions reused in the stats."""
        if self.prefix is None or not takes_past:
            return self.prompt, None
        self.stats.prefix_positions += self.prefix.positions
        return self.prompt[:, self.prefix.positions:], self.prefix.kv

    def accept(self, logp: np.ndarray) -> int | None:
        """Sample from this step's logp [V]; the token to emit, or None (EOS or
        a fill token). Sets `finished` when the request is done."""
        ignore_eos = self._next_step()
        return self._take(self.sampler.sample(logp, self.stats.tokens, ignore_eos=ignore_eos))

    def _next_step(self) -> bool:
        """Counts the step about to be sampled; whether EOS is held back at it."""
        if self.finished:
            raise RuntimeError("accept() after the request finished")
        i = self.index
        self.index += 1
        self.stats.steps += 1
        return i < self.min_len

    def _take(self, token: int) -> int | None:
        if token == self.eos:
            self.finished = True
            return None
        self.finished = self.index >= self.max_len
        if token > self.eos:
            # A fill token: upstream does not emit it and feeds the same input
            # again at the next position. (At step 0 upstream would re-feed the
            # whole prompt; we re-feed its last position.)
            return None
        self.stats.tokens.append(token)
        self.next_input = self._speech_embedding[token]
        return token


def accept_rows(decodes: Sequence[RequestDecode], logps: np.ndarray) -> list[int | None | SynthesisError]:
    """`accept` for each request of a batched step (its logp a row of [B, V]), sampled together
    (sampling.sample_rows: each row's token is the one it gets alone); a request whose sampling
    fails gets its error in its place."""
    ignore_eos = [d._next_step() for d in decodes]
    tokens = sample_rows([d.sampler for d in decodes], logps, [d.stats.tokens for d in decodes], ignore_eos)
    return [t if isinstance(t, SynthesisError) else d._take(t) for d, t in zip(decodes, tokens, strict=True)]
