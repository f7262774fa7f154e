"""English number words, written here so the runtime needs no `inflect`.

Cardinals (short scale, up to 10^36 - 1), ordinals, years, decimals, digit
strings and fractions. Style: American, no "and" after "hundred", hyphens in
compound tens ("twenty-five"). Upstream's fallback `spell_out_number` uses
inflect ("one thousand, two hundred and thirty-four"); the text normalizer it
runs first (wetext, NeMo grammars) writes "one thousand two hundred thirty
four". We follow the latter, which is what most of the text went through.
"""

from __future__ import annotations

_ONES = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen",
)
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
_SCALES = (
    "",
    "thousand",
    "million",
    "billion",
    "trillion",
    "quadrillion",
    "quintillion",
    "sextillion",
    "septillion",
    "octillion",
    "nonillion",
    "decillion",
)
MAX_CARDINAL = 10 ** (3 * len(_SCALES)) - 1

# Last word of a cardinal -> its ordinal form; the rest take "th" / "ieth".
_ORDINAL_WORDS = {
    "one": "first",
    "two": "second",
    "three": "third",
    "five": "fifth",
    "eight": "eighth",
    "nine": "ninth",
    "twelve": "twelfth",
}


def _below_100(n: int) -> str:
    if n < 20:
        return _ONES[n]
    tens, ones = divmod(n, 10)
    return _TENS[tens] + (f"-{_ONES[ones]}" if ones else "")


def _below_1000(n: int) -> str:
    hundreds, rest = divmod(n, 100)
    parts = []
    if hundreds:
        parts.append(f"{_ONES[hundreds]} hundred")
    if rest:
        parts.append(_below_100(rest))
    return " ".join(parts)


def cardinal(n: int) -> str:
    """12345 -> 'twelve thousand three hundred forty-five'. Numbers beyond
    the decillions are read digit by digit."""
    if n < 0:
        return "minus " + cardinal(-n)
    if n == 0:
        return "zero"
    if n > MAX_CARDINAL:
        return digits(str(n))
    groups = []
    scale = 0
    while n:
        n, group = divmod(n, 1000)
        if group:
            words = _below_1000(group)
            groups.append(f"{words} {_SCALES[scale]}" if scale else words)
        scale += 1
    return " ".join(reversed(groups))


def ordinal(n: int) -> str:
    """21 -> 'twenty-first', 100 -> 'one hundredth'."""
    words = cardinal(n)
    head, sep, last = max(
        (words.rpartition(" "), words.rpartition("-")), key=lambda parts: len(parts[0])
    )
    if last in _ORDINAL_WORDS:
        last = _ORDINAL_WORDS[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return head + sep + last


def digits(s: str) -> str:
    """'007' -> 'zero zero seven' (non-digits are dropped)."""
    return " ".join(_ONES[int(c)] for c in s if c.isdigit())


def decimal(s: str) -> str:
    """'3.14' -> 'three point one four', '.5' -> 'point five', '1,234.5' ok."""
    integer, _, fraction = s.replace(",", "").partition(".")
    words = cardinal(int(integer)) if integer else ""
    if fraction:
        words = f"{words} point {digits(fraction)}".strip()
    return words


def number(s: str) -> str:
    """Any plain numeral: '1,234' / '3.5' / '-2' -> words."""
    s = s.replace(",", "")
    if s.startswith("-"):
        return "minus " + number(s[1:])
    return decimal(s) if "." in s else cardinal(int(s))


def year(n: int) -> str:
    """1990 -> 'nineteen ninety', 1905 -> 'nineteen oh five', 2000 -> 'two
    thousand', 2007 -> 'two thousand seven', 2025 -> 'twenty twenty-five',
    1900 -> 'nineteen hundred'. Outside 1000..9999: the cardinal."""
    if not 1000 <= n <= 9999 or (2000 <= n <= 2009) or n % 1000 == 0:
        return cardinal(n)
    high, low = divmod(n, 100)
    if low == 0:
        return f"{_below_100(high)} hundred"
    if low < 10:
        return f"{_below_100(high)} oh {_ONES[low]}"
    return f"{_below_100(high)} {_below_100(low)}"


def plural(words: str) -> str:
    """Pluralise the last word of a number phrase: 'nineteen ninety' ->
    'nineteen nineties', 'fourth' -> 'fourths', 'half' -> 'halves'."""
    head, sep, last = max(
        (words.rpartition(" "), words.rpartition("-")), key=lambda parts: len(parts[0])
    )
    if last == "half":
        last = "halves"
    elif last.endswith("y"):
        last = last[:-1] + "ies"
    elif last.endswith(("s", "x")):
        last += "es"
    else:
        last += "s"
    return head + sep + last


def fraction(numerator: int, denominator: int) -> str:
    """3/4 -> 'three quarters', 1/2 -> 'one half', 5/8 -> 'five eighths',
    denominators over 100 -> 'x over y'."""
    if denominator == 0 or denominator > 100:
        return f"{cardinal(numerator)} over {cardinal(denominator)}"
    if denominator == 1:
        return cardinal(numerator)
    name = {2: "half", 4: "quarter"}.get(denominator) or ordinal(denominator)
    return f"{cardinal(numerator)} {name if numerator == 1 else plural(name)}"
