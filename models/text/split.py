"""Sentence and paragraph splitting for synthesis, as upstream's
`cosyvoice.utils.frontend_utils.split_paragraph` and `is_only_punctuation`.

`split_paragraph` with the upstream defaults (token_max_n=80, token_min_n=60,
merge_len=20, comma_split=False) returns what upstream returns for 'zh'
(lengths in characters) and 'en' (lengths in tokens of the given tokenize
function), including upstream's quirks: a terminal '。' / '.' is added when
the text does not end in a sentence mark, a closing quote after a sentence
mark stays with that sentence, and the repeats in a run of sentence marks
('?!', '...') are dropped. Where upstream raises (empty text, a text that
starts with a sentence mark and a quote) we return [] / drop the quote.

Two options, both off by default so the output stays upstream's:
* `first_segment_max_n`: the first segment is at most this long (it is cut
  after a comma or other pause mark if its first sentence is longer), so the
  first audio of a long text comes sooner; the rest is split as usual.
* `max_segment_n`: a hard cap for text with too little punctuation (upstream
  would hand the LLM an arbitrarily long segment): longer sentences are cut
  after pause marks, else at spaces, else between characters.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

ZH_SENTENCE_MARKS = ("。", "？", "！", "；", "：", "、", ".", "?", "!", ";")
EN_SENTENCE_MARKS = (".", "?", "!", ";", ":")
# Text in other scripts is measured in tokens like English but may use the
# full-width marks too (Japanese kana, for one).
OTHER_SENTENCE_MARKS = EN_SENTENCE_MARKS + ("。", "？", "！", "；", "：")
COMMAS = ("，", ",")
CLOSING_QUOTES = ('"', "”")

_PAUSE_CUT = re.compile(r"(?<=[，,、；;：:])")
_SPACE_CUT = re.compile(r"(?<=\s)")

SplitLanguage = Literal["zh", "en", "other"]
Tokenize = Callable[[str], Sequence[int]]


@dataclass(frozen=True)
class SplitSettings:
    """How text is cut into synthesis segments (lengths: characters for
    Chinese, tokens otherwise). The defaults are upstream's."""

    token_max_n: int = 80
    token_min_n: int = 60
    merge_len: int = 20
    comma_split: bool = False
    first_segment_max_n: int | None = None
    max_segment_n: int | None = None

    def __post_init__(self) -> None:
        for name in ("token_max_n", "token_min_n", "merge_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"SplitSettings.{name} must be >= 0, not {getattr(self, name)}")
        for name in ("first_segment_max_n", "max_segment_n"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"SplitSettings.{name} must be None (off) or >= 1, not {value}")


def is_only_punctuation(text: str) -> bool:
    """True for text made only of punctuation and symbols (Unicode P* and S*
    categories), and for the empty string, as upstream's regex."""
    return all(unicodedata.category(c)[0] in "PS" for c in text)


def split_sentences(text: str, marks: Sequence[str], terminal: str) -> list[str]:
    """Cut after each sentence mark (a closing quote right after it stays
    with the sentence); a mark right after another one is dropped."""
    if not text:
        return []
    if text[-1] not in marks:
        text += terminal
    sentences: list[str] = []
    start = 0
    for i, c in enumerate(text):
        if c not in marks:
            continue
        if i > start:
            sentences.append(text[start:i] + c)
        if i + 1 < len(text) and text[i + 1] in CLOSING_QUOTES:
            if sentences:
                sentences[-1] += text[i + 1]
            start = i + 2
        else:
            start = i + 1
    return sentences


def _break(
    text: str, limit: int, length: Callable[[str], int], cuts: Sequence[re.Pattern[str] | None]
) -> list[str]:
    """Cut `text` into pieces of at most `limit` where possible, preferring
    the cut points of `cuts` in order (None: between any two characters).
    The pieces concatenate to `text`."""
    if length(text) <= limit or not cuts:
        return [text]
    cut, finer = cuts[0], cuts[1:]
    parts = [p for p in (cut.split(text) if cut is not None else list(text)) if p]
    if len(parts) <= 1:
        return _break(text, limit, length, finer)
    chunks: list[str] = []
    current = ""
    for part in parts:
        if current and length(current + part) > limit:
            chunks.append(current)
            current = ""
        current += part
    if current:
        chunks.append(current)
    return [piece for chunk in chunks for piece in _break(chunk, limit, length, finer)]


def _first_segment(
    sentences: list[str], limit: int, length: Callable[[str], int]
) -> tuple[str, list[str]]:
    first = sentences[0]
    if length(first) > limit:
        pieces = _break(first, limit, length, (_PAUSE_CUT,))
        rest = first[len(pieces[0]):]
        return pieces[0], ([rest] if rest else []) + sentences[1:]
    taken = 1
    while taken < len(sentences) and length(first + sentences[taken]) <= limit:
        first += sentences[taken]
        taken += 1
    return first, sentences[taken:]


def split_paragraph(
    text: str,
    tokenize: Tokenize,
    lang: SplitLanguage = "zh",
    token_max_n: int = 80,
    token_min_n: int = 60,
    merge_len: int = 20,
    comma_split: bool = False,
    *,
    first_segment_max_n: int | None = None,
    max_segment_n: int | None = None,
) -> list[str]:
    """Split a normalized paragraph into synthesis segments (see the module
    docstring). `tokenize` measures non-Chinese text."""
    if lang == "zh":
        marks: tuple[str, ...] = ZH_SENTENCE_MARKS
        terminal = "。"

        def length(s: str) -> int:
            return len(s)
    else:
        marks = EN_SENTENCE_MARKS if lang == "en" else OTHER_SENTENCE_MARKS
        terminal = "."

        def length(s: str) -> int:
            return len(tokenize(s)) if s else 0

    if comma_split:
        marks += COMMAS
    sentences = split_sentences(text, marks, terminal)
    if max_segment_n is not None:
        cuts = (_PAUSE_CUT, _SPACE_CUT, None)
        sentences = [piece for s in sentences for piece in _break(s, max_segment_n, length, cuts)]

    segments: list[str] = []
    fixed = 0  # leading segments the tail must not be merged into
    if first_segment_max_n is not None and sentences:
        first, sentences = _first_segment(sentences, first_segment_max_n, length)
        segments.append(first)
        fixed = 1
    current = ""
    for sentence in sentences:
        flush = length(current + sentence) > token_max_n and length(current) > token_min_n
        if max_segment_n is not None and current and length(current + sentence) > max_segment_n:
            flush = True
        if flush:
            segments.append(current)
            current = ""
        current += sentence
    if current:
        merge = length(current) < merge_len and len(segments) > fixed
        if merge and max_segment_n is not None:
            merge = length(segments[-1] + current) <= max_segment_n
        if merge:
            segments[-1] += current
        else:
            segments.append(current)
    return segments


def split_with(text: str, tokenize: Tokenize, lang: SplitLanguage, settings: SplitSettings) -> list[str]:
    """`split_paragraph` with a SplitSettings."""
    return split_paragraph(
        text,
        tokenize,
        lang,
        settings.token_max_n,
        settings.token_min_n,
        settings.merge_len,
        settings.comma_split,
        first_segment_max_n=settings.first_segment_max_n,
        max_segment_n=settings.max_segment_n,
    )


# Streaming text (Wyoming synthesize-chunk): a sentence is complete once a
# sentence mark is followed by whitespace (or, for the full-width marks, at
# once; a closing quote stays with it) or at a line break, so "3." + "14" or
# "Mr" + "." stay open until more text shows where the boundary is.
_HALF = re.escape("".join(m for m in OTHER_SENTENCE_MARKS if ord(m) < 128))
_FULL = re.escape("".join(m for m in OTHER_SENTENCE_MARKS if ord(m) >= 128))
_QUOTES = re.escape("".join(CLOSING_QUOTES))
_STREAM_BOUNDARY = re.compile(rf"(?<=[{_HALF}])[{_QUOTES}]?\s+|(?<=[{_FULL}])[{_QUOTES}]?|\n+")


def cut_sentences(text: str, max_chars: int = 400) -> list[str]:
    """Non-empty, stripped sentences at the streaming boundaries; one longer
    than `max_chars` is cut at its last space (or hard), so no piece grows
    unbounded."""
    out: list[str] = []
    start = 0
    pieces = []
    for m in _STREAM_BOUNDARY.finditer(text):
        pieces.append(text[start:m.end()])
        start = m.end()
    pieces.append(text[start:])
    for part in pieces:
        part = part.strip()
        while len(part) > max_chars:
            cut = part.rfind(" ", 0, max_chars)
            cut = max_chars if cut <= 0 else cut
            out.append(part[:cut].strip())
            part = part[cut:].strip()
        if part:
            out.append(part)
    return out


def complete_sentences(text: str, max_chars: int = 400) -> tuple[list[str], str]:
    """For streamed text: (the sentences already complete, the unfinished rest)."""
    end = 0
    for m in _STREAM_BOUNDARY.finditer(text):
        end = m.end()
    head, rest = text[:end], text[end:]
    # an over-long unfinished sentence is cut as cut_sentences would cut it
    while len(rest) > max_chars:
        cut = rest.rfind(" ", 0, max_chars)
        cut = max_chars if cut <= 0 else cut
        head, rest = head + rest[:cut] + "\n", rest[cut:].lstrip()
    return cut_sentences(head, max_chars), rest
