"""The Qwen2 text tokenizer of CosyVoice 2 through the `tokenizers` library.

Matches upstream `cosyvoice.tokenizer.tokenizer.QwenTokenizer`: a HF
AutoTokenizer on `CosyVoice-BlankEN` with CosyVoice's special tokens added
(`<|endofprompt|>`, `[breath]`, `<strong>`, `[laughter]`, ...). The bundle's
`tokenizer.json` is that tokenizer's backend saved after the tokens were added,
so `Tokenizer.from_file` + `encode(text).ids` gives the same ids as
`QwenTokenizer.encode` (Qwen2 adds no BOS/EOS), and `decode` skips special
tokens as `QwenTokenizer.decode` does by default.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from cosyedge_models.errors import BundleError
from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

# The tokens upstream's QwenTokenizer adds (eos/pad first, then the additional ones).
COSYVOICE_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endofprompt|>",
    "[breath]",
    "<strong>",
    "</strong>",
    "[noise]",
    "[laughter]",
    "[cough]",
    "[clucking]",
    "[accent]",
    "[quick_breath]",
    "<laughter>",
    "</laughter>",
    "[hissing]",
    "[sigh]",
    "[vocalized-noise]",
    "[lipsmack]",
    "[mn]",
)
END_OF_PROMPT = "<|endofprompt|>"


class TextTokenizer:
    """Text -> token ids for the LLM. Thread-safe for encode/decode (the Rust
    tokenizer holds no per-call state)."""

    def __init__(self, tokenizer: Tokenizer, *, require_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        # Qwen2 adds nothing around the text; a tokenizer.json with a post
        # processor that does would shift every id the LLM sees.
        self._tok.no_padding()
        self._tok.no_truncation()
        added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
        missing = [t for t in COSYVOICE_SPECIAL_TOKENS if t not in added]
        self.missing_special_tokens: tuple[str, ...] = tuple(missing)
        if missing and require_special_tokens:
            raise BundleError(
                "the tokenizer lacks CosyVoice's special tokens "
                f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; "
                "tokenizer.json must be the CosyVoice-BlankEN tokenizer saved after "
                "QwenTokenizer's add_special_tokens (re-run `cosyedge build export`)"
            )
        self.special_tokens: frozenset[str] = frozenset(added)

    @classmethod
    def from_file(cls, path: str | Path, *, require_special_tokens: bool = True) -> TextTokenizer:
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise BundleError(f"tokenizer file not found: {p} (expected a `tokenizers` tokenizer.json)")
        try:
            tok = Tokenizer.from_file(str(p))
        except Exception as exc:  # the Rust side raises a bare Exception on bad JSON
            raise BundleError(f"cannot load tokenizer {p}: {exc}") from exc
        return cls(tok, require_special_tokens=require_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Number of ids incl. added tokens (the largest id + 1)."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=True)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        tid = self._tok.token_to_id(token)
        return None if tid is None else int(tid)
