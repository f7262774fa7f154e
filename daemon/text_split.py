"""Splits text into sentences for per-sentence streaming: each sentence is
synthesized and played as one chunk, so the first one plays while the next
ones are still being made."""

from __future__ import annotations

import re

# A sentence ends at . ! ? ; (and CJK 。！？；) followed by whitespace or the end,
# or at a line break. Abbreviations are not special-cased: a spurious split
# only costs a short pause.
_BOUNDARY = re.compile(r"(?<=[.!?;。！？；])\s+|(?<=[。！？；])|\n+")


def split_sentences(text: str, max_chars: int = 400) -> list[str]:
    """Non-empty, stripped sentences; a sentence longer than `max_chars` is
    cut at the last space (or hard) so one chunk never grows unbounded."""
    out: list[str] = []
    for part in _BOUNDARY.split(text):
        part = part.strip()
        while len(part) > max_chars:
            cut = part.rfind(" ", 0, max_chars)
            if cut <= 0:
                cut = max_chars
            out.append(part[:cut].strip())
            part = part[cut:].strip()
        if part:
            out.append(part)
    return out


def complete_sentences(text: str, max_chars: int = 400) -> tuple[list[str], str]:
    """For streamed text: (the sentences already complete, the unfinished rest).
    A sentence is complete once a boundary follows it (a mark and then
    whitespace, a CJK mark, a line break), so "3." + "14" or "Mr" + "." stay
    open until more text shows where the boundary is."""
    end = 0
    for m in _BOUNDARY.finditer(text):
        end = m.end()
    head, rest = text[:end], text[end:]
    # an over-long unfinished sentence is cut as split_sentences would cut it
    while len(rest) > max_chars:
        cut = rest.rfind(" ", 0, max_chars)
        cut = max_chars if cut <= 0 else cut
        head, rest = head + rest[:cut] + "\n", rest[cut:].lstrip()
    return split_sentences(head, max_chars), rest
