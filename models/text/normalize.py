"""Text normalization for the CosyVoice 2 frontend, without pynini, ttsfrd or
wetext.

Matches upstream `CosyVoiceFrontEnd.text_normalize(text, split=False)` (the
wetext branch, upstream commit 44316c3 plus the later rule that skips the
frontend when the text holds `<|...|>` markup) step by step:

* Chinese (the text contains a CJK ideograph, upstream's `contains_chinese`):
  the Chinese number/unit rules (`normalize_zh`, standing in for wetext's
  ZhNormalizer), then upstream's punctuation rules: newlines removed,
  `replace_blank` (spaces only survive between two ASCII characters),
  `replace_corner_mark` (² 平方, ³ 立方), '.' -> '。', ' - ' -> '，',
  `remove_bracket` (（）【】` removed, —— to a space), and a trailing run of
  ，,、 becomes 。.
* English (everything else in Latin script): the English rules
  (`normalize_en`, standing in for wetext's EnNormalizer and inflect's
  `spell_out_number`); full-width punctuation becomes ASCII (the English
  splitter only knows ASCII sentence marks), whitespace collapses and a line
  break after a word ends the sentence.
* Other scripts (Cyrillic, Greek, Hangul, kana-only Japanese, Arabic, ...):
  whitespace and full-width forms only; numbers stay digits, since spelling
  them in English (what upstream does) is wrong there.

Always: full-width ASCII letters and digits become half-width, NBSP and
ideographic spaces become spaces, zero-width and other format characters
and stray control characters are removed, and CosyVoice's special tokens
(`[breath]`, `<strong>`, ...) pass through untouched.
"""

from __future__ import annotations

import logging
import re
import unicodedata
from collections.abc import Iterable
from typing import Literal

from cosyedge_models.text.normalize_en import normalize_english
from cosyedge_models.text.normalize_zh import normalize_chinese
from cosyedge_models.text.tokenizer import COSYVOICE_SPECIAL_TOKENS

logger = logging.getLogger(__name__)

Language = Literal["zh", "en", "other"]
LANGUAGE_CHOICES = ("auto", "zh", "en", "other")

_CHINESE = re.compile(r"[\u4e00-\u9fff]")  # upstream's chinese_char_pattern

# Full-width punctuation -> ASCII, for the English path only (in Chinese text
# upstream keeps full-width punctuation: it is what the splitter looks for).
_FULLWIDTH_PUNCTUATION = str.maketrans({
    # full-width marks carry their own spacing; spaces collapse afterwards
    "，": ", ", "。": ". ", "！": "! ", "？": "? ", "：": ": ", "；": "; ", "（": " (", "）": ") ",
    "“": '"', "”": '"', "‘": "'", "’": "'", "、": ", ", "【": "[", "】": "]", "《": '"', "》": '"',
    "…": "...", "～": "~",
})
# U+FF01..FF5E are full-width forms of ASCII 0x21..0x7E; only letters and
# digits are folded for every language (punctuation depends on the language).
_FULLWIDTH_ALNUM = str.maketrans({
    chr(c): chr(c - 0xFEE0) for c in range(0xFF01, 0xFF5F) if chr(c - 0xFEE0).isalnum()
})
_SPACES = re.compile(r"[\u00a0\u2000-\u200a\u202f\u205f\u3000]")


def contains_chinese(text: str) -> bool:
    """Whether the text has a CJK unified ideograph (upstream's test)."""
    return bool(_CHINESE.search(text))


def _is_latin(c: str) -> bool:
    o = ord(c)
    return o < 0x250 or 0x1E00 <= o < 0x1F00 or 0xFF21 <= o <= 0xFF5A


def detect_language(text: str) -> Language:
    """'zh' if any CJK ideograph (so kanji Japanese too, as upstream), 'en'
    if the letters are mostly Latin (or there are none), else 'other'."""
    if contains_chinese(text):
        return "zh"
    letters = [c for c in text if c.isalpha()]
    latin = sum(1 for c in letters if _is_latin(c))
    return "en" if latin * 2 >= len(letters) else "other"


def replace_blank(text: str) -> str:
    """Upstream's replace_blank: a space survives only between two ASCII
    non-space characters (so spaces between Chinese characters go). Unlike
    upstream, a space at either end is dropped instead of indexing around."""
    out = []
    last = len(text) - 1
    for i, c in enumerate(text):
        if c == " ":
            prev_ok = i > 0 and text[i - 1].isascii() and text[i - 1] != " "
            next_ok = i < last and text[i + 1].isascii() and text[i + 1] != " "
            if prev_ok and next_ok:
                out.append(c)
        else:
            out.append(c)
    return "".join(out)


def replace_corner_mark(text: str) -> str:
    return text.replace("²", "平方").replace("³", "立方")


def remove_bracket(text: str) -> str:
    for c in "（）【】`":
        text = text.replace(c, "")
    return text.replace("——", " ")


def clean_characters(text: str) -> str:
    """Characters that are never spoken: tabs and odd spaces become spaces,
    CR LF becomes LF, control and format characters (zero-width space, BOM,
    soft hyphen) are removed; full-width letters and digits become ASCII."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\t", " ")
    text = _SPACES.sub(" ", text)
    text = "".join(c for c in text if c == "\n" or unicodedata.category(c) not in ("Cc", "Cf", "Cs"))
    return text.translate(_FULLWIDTH_ALNUM)


def _split_special(text: str, special_tokens: Iterable[str]) -> list[tuple[bool, str]]:
    """[(is_special, piece), ...] covering the text."""
    tokens = sorted({t for t in special_tokens if t}, key=len, reverse=True)
    if not tokens:
        return [(False, text)]
    pattern = re.compile("(" + "|".join(re.escape(t) for t in tokens) + ")")
    return [(i % 2 == 1, piece) for i, piece in enumerate(pattern.split(text)) if piece]


def _map_plain(text: str, special_tokens: Iterable[str], fn) -> str:  # type: ignore[no-untyped-def]
    return "".join(piece if special else fn(piece) for special, piece in _split_special(text, special_tokens))


def _english_lines(text: str) -> str:
    # A line that ends in a word, followed by one that starts a sentence, is a
    # sentence of its own (titles, lists); other line breaks are soft wraps.
    text = re.sub(r"(?<=\w)[ \t]*\n\s*(?=[A-Z0-9\"“])", ". ", text)
    return re.sub(r"\s+", " ", text)


def normalize_text(
    text: str,
    language: str = "auto",
    special_tokens: Iterable[str] = COSYVOICE_SPECIAL_TOKENS,
) -> tuple[str, Language]:
    """Normalize `text` for the tokenizer. Returns the text and the language
    the splitter should use. `language`: 'auto' (by script, as upstream),
    'zh', 'en' or 'other'."""
    if language not in LANGUAGE_CHOICES:
        raise ValueError(f"language must be one of {', '.join(LANGUAGE_CHOICES)}, not {language!r}")
    lang: Language = detect_language(text) if language == "auto" else language  # type: ignore[assignment]
    if "<|" in text and "|>" in text:
        # Upstream skips its whole frontend for text with <|...|> markup.
        return text, lang
    specials = tuple(special_tokens)
    text = clean_characters(text).strip()
    if lang == "zh":
        text = re.sub(r"[ ]{2,}", " ", text)
        text = _map_plain(text, specials, normalize_chinese)
        text = text.replace("\n", "")
        text = replace_blank(text)
        text = replace_corner_mark(text)
        text = text.replace(".", "。")
        text = text.replace(" - ", "，")
        text = remove_bracket(text)
        text = re.sub(r"[，,、]+$", "。", text)
    elif lang == "en":
        text = _english_lines(text.translate(_FULLWIDTH_PUNCTUATION))
        text = _map_plain(text, specials, normalize_english)
        text = re.sub(r"\s+", " ", text).strip()
    else:
        text = re.sub(r"\s+", " ", text).strip()
    return text, lang
