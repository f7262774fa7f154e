"""A rewrite rule (a regex and what its matches become) and helpers shared
by the English and Chinese rule tables."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

# A plain numeral: comma-grouped or bare digits, with an optional decimal part.
NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: re.Pattern[str]
    replace: Callable[[re.Match[str]], str]

    def apply(self, text: str) -> str:
        return self.pattern.sub(self.replace, text)


def rule(name: str, pattern: str, replace: Callable[[re.Match[str]], str], flags: int = 0) -> Rule:
    return Rule(name, re.compile(pattern, flags), replace)


def alternation(keys: Iterable[str]) -> str:
    """A regex alternation of literal keys, longest first so 'km/h' wins over 'km'."""
    return "|".join(re.escape(k) for k in sorted(keys, key=len, reverse=True))


def table_rule(name: str, table: Mapping[str, str], before: str = "", after: str = "") -> Rule:
    """Replace each key of `table` (literally) by its value."""
    pattern = f"{before}(?:{alternation(table)}){after}"
    return rule(name, pattern, lambda m: table[m.group(0)])


def apply_rules(rules: Iterable[Rule], text: str) -> str:
    for r in rules:
        text = r.apply(text)
    return text


def spaced(m: re.Match[str], words: str) -> str:
    """`words` with a space added where the match touches a letter, so
    'mp3' becomes 'mp three', not 'mpthree'."""
    s, start, end = m.string, m.start(), m.end()
    if start > 0 and s[start - 1].isalpha():
        words = " " + words
    if end < len(s) and s[end].isalpha():
        words += " "
    return words
