"""The LLM half of the per-voice prompt cache: the KV cache of the part of
the LLM's input that does not depend on the request.

CosyVoice 2's LLM input is [sos] [prompt text … request text] [task_id]
[prompt speech tokens] (models/synthesis/llm.py `prompt_embeds`). Attention is
causal, so the keys and values of `sos` + a saved zero_shot voice's
transcript are the same whatever request follows; they are computed once per
voice (`build_llm_prefix`, an `llm_prefill` over those positions) and each
request runs only the rest (request text, task_id, prompt speech tokens)
through `llm_decode` with T new positions over them (`DecodeLoop.prefill(rest,
past=prefix.kv)`). The prompt speech tokens come after the request's text,
so their keys and values are not cacheable.

Not used for cross_lingual (the prefix would be `sos` alone) nor instruct
(its prompt text is the request's instruct text), nor with a bundle whose
`llm_decode` takes one position (`Bundle.llm_decode_positions`), nor by a
decode loop that cannot start from a saved cache (`DecodeLoop.takes_past`:
the TensorRT loop); those prefill the whole prompt (the same tokens)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from cosyedge_models.backends.base import Session


@dataclass(frozen=True, eq=False)
class LlmPrefix:
    """The KV cache [L, 2, 1, Hkv, P, hd] (host memory, read-only) of the
    first P positions of the LLM input: sos + `prompt_text`."""

    prompt_text: tuple[int, ...]
    kv: np.ndarray
    build_ms: float = 0.0

    @property
    def positions(self) -> int:
        return int(self.kv.shape[4])

    def nbytes(self) -> int:
        return int(self.kv.nbytes)

    def describe(self) -> str:
        return f"LLM prefix of {self.positions} positions"

    def retire(self) -> None:
        """Host memory only: nothing to free beyond the reference the cache drops."""

    def matches(self, prompt_text: Sequence[int]) -> bool:
        """Whether an input's prompt text is the one this prefix was built from."""
        return tuple(prompt_text) == self.prompt_text


def prefix_embeds(sos: np.ndarray, text_embedding: np.ndarray, prompt_text: Sequence[int]) -> np.ndarray:
    """[1, 1 + len(prompt_text), D]: the first rows of SpeechTokenLM.prompt_embeds."""
    text = np.asarray(text_embedding[np.asarray(list(prompt_text), dtype=np.int64)], dtype=np.float32)
    return np.concatenate([sos[None].astype(np.float32), text.reshape(-1, sos.shape[0])], axis=0)[None]


def build_llm_prefix(prefill: Session, sos: np.ndarray, text_embedding: np.ndarray,
                     prompt_text: Sequence[int]) -> LlmPrefix:
    """One `llm_prefill` over sos + the transcript; its cache as a host array."""
    t0 = time.perf_counter()
    embeds = prefix_embeds(sos, text_embedding, prompt_text)
    out = prefill.run({"inputs_embeds": embeds, "attention_mask": np.ones(embeds.shape[:2], dtype=np.int64)},
                      ["present_kv"])
    kv = np.ascontiguousarray(out["present_kv"])
    kv.setflags(write=False)  # shared by every request of the voice
    return LlmPrefix(tuple(int(t) for t in prompt_text), kv, (time.perf_counter() - t0) * 1e3)


def prompt_text_digest(prompt_text: Sequence[int]) -> str:
    """What an LLM prefix is built from (the transcript's token ids): its cache key's digest."""
    return hashlib.sha256(np.asarray(list(prompt_text), dtype=np.int64).tobytes()).hexdigest()[:16]
