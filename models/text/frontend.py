"""The text frontend: validate, normalize, split and tokenize request text.

Matches upstream `CosyVoiceFrontEnd.text_normalize` + `_extract_text_token`
(see `normalize`, `split` and `tokenizer` for the details of each step):
`prepare(text)` is `text_normalize(text, split=True)` followed by the
tokenizer on each segment, with punctuation-only segments dropped;
`prepare_prompt_text` is `text_normalize(prompt_text, split=False)` +
tokenizer (zero-shot's transcript); `prepare_instruct` is instruct2's
`instruct_text + '<|endofprompt|>'` (not normalized, as upstream).

Unlike upstream, bad input is refused with a `RequestError` whose code is
stable: `invalid_text` (not a string, control characters), `empty_text`,
`text_too_long`, `no_speakable_text` (nothing left after normalization).
"""

from __future__ import annotations

import logging
import unicodedata
from dataclasses import dataclass

import numpy as np
from cosyedge_models.errors import RequestError
from cosyedge_models.synthesis.api import MAX_TEXT_CHARS
from cosyedge_models.text.normalize import LANGUAGE_CHOICES, Language, detect_language, normalize_text
from cosyedge_models.text.split import SplitSettings, is_only_punctuation, split_with
from cosyedge_models.text.tokenizer import END_OF_PROMPT, TextTokenizer

logger = logging.getLogger(__name__)

INVALID_TEXT = "invalid_text"
EMPTY_TEXT = "empty_text"
TEXT_TOO_LONG = "text_too_long"
NO_SPEAKABLE_TEXT = "no_speakable_text"

# The frontend caps segments that have too little punctuation to be split
# (upstream would feed the LLM all of it at once); otherwise upstream's rules.
DEFAULT_SPLIT = SplitSettings(max_segment_n=200)
_ALLOWED_CONTROL = frozenset("\t\n\r")


@dataclass(frozen=True)
class Segment:
    """One piece of text the LLM synthesizes in one go."""

    text: str  # normalized
    token_ids: np.ndarray  # int64 [T]
    language: Language


class TextFrontend:
    def __init__(
        self,
        tokenizer: TextTokenizer,
        *,
        max_text_chars: int = MAX_TEXT_CHARS,
        max_instruct_chars: int = 500,
        language: str = "auto",
        normalize: bool = True,
        split: SplitSettings = DEFAULT_SPLIT,
    ) -> None:
        if language not in LANGUAGE_CHOICES:
            raise ValueError(f"language must be one of {', '.join(LANGUAGE_CHOICES)}, not {language!r}")
        if max_text_chars < 1 or max_instruct_chars < 1:
            raise ValueError("max_text_chars and max_instruct_chars must be >= 1")
        self.tokenizer = tokenizer
        self.max_text_chars = max_text_chars
        self.max_instruct_chars = max_instruct_chars
        self.language = language
        self.normalize_enabled = normalize
        self.split_settings = split

    def _validate(self, text: object, field: str, limit: int) -> str:
        if not isinstance(text, str):
            raise RequestError(INVALID_TEXT, f"{field} must be a string, not {type(text).__name__}")
        if not text.strip():
            raise RequestError(EMPTY_TEXT, f"{field} is empty")
        if len(text) > limit:
            raise RequestError(
                TEXT_TOO_LONG, f"{field} has {len(text)} characters; the limit is {limit}"
            )
        for position, c in enumerate(text):
            category = unicodedata.category(c)
            if (category == "Cc" and c not in _ALLOWED_CONTROL) or category == "Cs":
                raise RequestError(
                    INVALID_TEXT,
                    f"{field} contains the control character U+{ord(c):04X} at position {position}; "
                    "only tab, CR and LF are allowed",
                )
        return text

    def check(self, text: object) -> None:
        """The cheap admission checks of `prepare` (type, empty, length, control characters)."""
        self._validate(text, "text", self.max_text_chars)

    def normalize(self, text: str) -> tuple[str, Language]:
        """Normalized text (not split) and its language."""
        if not self.normalize_enabled:
            language = detect_language(text) if self.language == "auto" else self.language
            return text, language  # type: ignore[return-value]
        return normalize_text(text, self.language, self.tokenizer.special_tokens)

    def prepare(self, text: str) -> list[Segment]:
        """Request text -> segments to synthesize one after another."""
        text = self._validate(text, "text", self.max_text_chars)
        normalized, language = self.normalize(text)
        if ("<|" in normalized and "|>" in normalized) or not self.normalize_enabled:
            # upstream's text_frontend=False / markup path: one segment as given
            pieces = [normalized]
        else:
            pieces = split_with(normalized, self.tokenizer.encode, language, self.split_settings)
        segments = []
        for piece in pieces:
            if is_only_punctuation(piece) or not piece.strip():
                continue
            ids = np.asarray(self.tokenizer.encode(piece), dtype=np.int64)
            if ids.size:
                segments.append(Segment(piece, ids, language))
        if not segments:
            raise RequestError(
                NO_SPEAKABLE_TEXT,
                f"text has nothing to speak after normalization (it was {text[:40]!r}); "
                "send words, not only punctuation or symbols",
            )
        logger.debug("text split into %d segment(s)", len(segments))
        return segments

    def prepare_prompt_text(self, transcript: str) -> np.ndarray:
        """The transcript of a voice prompt (zero-shot) -> token ids [T] int64.
        An empty transcript (cross-lingual) gives no ids."""
        if isinstance(transcript, str) and not transcript.strip():
            return np.zeros(0, dtype=np.int64)
        transcript = self._validate(transcript, "prompt transcript", self.max_text_chars)
        normalized, _ = self.normalize(transcript)
        return np.asarray(self.tokenizer.encode(normalized), dtype=np.int64)

    def prepare_instruct(self, instruct_text: str) -> np.ndarray:
        """instruct2's LLM prompt: `instruct_text + '<|endofprompt|>'` -> ids.
        A text that already ends with the marker does not get a second one."""
        instruct_text = self._validate(instruct_text, "instruct_text", self.max_instruct_chars)
        if not instruct_text.endswith(END_OF_PROMPT):
            instruct_text += END_OF_PROMPT
        return np.asarray(self.tokenizer.encode(instruct_text), dtype=np.int64)
