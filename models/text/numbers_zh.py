"""Chinese numerals for the text normalizer, as wetext's Chinese grammar
reads them: cardinals with 万/亿 sections and 零 for skipped places
(10010 -> 一万零一十, 15 -> 十五), digit strings read one by one (years, phone
numbers: 2025 -> 二零二五), decimals with 点 (3.05 -> 三点零五), fractions
with 分之 (3/4 -> 四分之三)."""

from __future__ import annotations

DIGITS = "零一二三四五六七八九"
_PLACES = ("千", "百", "十", "")
# Section units every four places: 个, 万, 亿, 万亿 (10^12); larger numbers are
# read digit by digit (nobody says 兆 for a number in running text).
_SECTIONS = ("", "万", "亿", "万亿")
MAX_CARDINAL = 10 ** (4 * len(_SECTIONS)) - 1


def digits(s: str) -> str:
    """'2025' -> '二零二五' (non-digits are dropped)."""
    return "".join(DIGITS[int(c)] for c in s if c.isdigit())


def _section(n: int) -> str:
    """0 < n < 10000 -> '一千零一十' etc., without the leading-一十 rule."""
    out: list[str] = []
    pending_zero = False
    for place, digit in zip(_PLACES, f"{n:04d}", strict=True):
        d = int(digit)
        if d == 0:
            pending_zero = bool(out)
            continue
        if pending_zero:
            out.append("零")
            pending_zero = False
        out.append(DIGITS[d] + place)
    return "".join(out)


def cardinal(n: int) -> str:
    """123 -> 一百二十三, 100010 -> 十万零一十, 10 -> 十, -5 -> 负五."""
    if n < 0:
        return "负" + cardinal(-n)
    if n == 0:
        return "零"
    if n > MAX_CARDINAL:
        return digits(str(n))
    sections = []
    while n:
        n, section = divmod(n, 10000)
        sections.append(section)
    out = ""
    zero_pending = False
    for index in range(len(sections) - 1, -1, -1):
        section = sections[index]
        if section == 0:
            zero_pending = bool(out)
            continue
        # A gap of places before this section (a zero section, or fewer than
        # four digits in it after a higher one) is read as one 零.
        if out and (zero_pending or section < 1000):
            out += "零"
        out += _section(section) + _SECTIONS[index]
        zero_pending = False
    # 10..19 at the start of a number are read 十, 十一, ... not 一十.
    return out[1:] if out.startswith("一十") else out


def decimal(s: str) -> str:
    """'3.5' -> '三点五', '0.05' -> '零点零五', '1,234.5' -> '一千二百三十四点五'."""
    s = s.replace(",", "")
    if s.startswith("-"):
        return "负" + decimal(s[1:])
    integer, _, fraction = s.partition(".")
    words = cardinal(int(integer)) if integer else "零"
    return f"{words}点{digits(fraction)}" if fraction else words


def number(s: str) -> str:
    """Any plain numeral: '1,000' / '3.5' / '-2' -> Chinese. Strings with a
    leading zero ('007') or of 11+ digits (mobile phone and ID numbers) are read
    digit by digit."""
    s = s.replace(",", "")
    if s.startswith("-"):
        return "负" + number(s[1:])
    if "." in s:
        return decimal(s)
    if (len(s) > 1 and s.startswith("0")) or len(s) >= 11:
        return digits(s)
    return cardinal(int(s))


def fraction(numerator: str, denominator: str) -> str:
    """'3', '4' -> '四分之三'."""
    return f"{number(denominator)}分之{number(numerator)}"
