"""English text normalization rules: what upstream gets from wetext's English
normalizer (NeMo grammars) followed by `spell_out_number`, approximated with
regex rules and our own number words (`numbers_en`).

Covered, in this order: abbreviations (Mr., Dr., etc., e.g., No. 5), money
($, €, £, ¥, ₹ with cents and million/bn scales), percentages, measures
(a table of units after a number), times (10:30, 5 pm), dates (January 5,
5 May 2025, 2025-01-05, 1/5/2025), decades (1990s, '90s), years (after in /
since / by ..., BC/AD, and bare 1900-2099), ordinals (1st), fractions (3/4),
phone-like digit groups, numeric ranges, negative numbers, symbols (&, @, =,
+, #5) and every remaining numeral (cardinal or decimal; leading-zero and
very long digit strings digit by digit).

Not covered: context beyond the local regex (an ambiguous "1/2" is a half,
"St." before a capitalised word is "saint"), roman numerals, URLs and
e-mail addresses, telephone formats other than NNN-NNNN(-NNNN), units not in
the table, non-English words in Latin script (numbers in them come out in
English, as upstream's do).
"""

from __future__ import annotations

import re

import cosyedge_models.text.numbers_en as en
from cosyedge_models.text.rules import NUM, Rule, alternation, rule, spaced

_CURRENCIES: dict[str, tuple[str, str, str | None, str | None]] = {
    # symbol: (one, many, one subunit, many subunits)
    "US$": ("US dollar", "US dollars", "cent", "cents"),
    "$": ("dollar", "dollars", "cent", "cents"),
    "€": ("euro", "euros", "cent", "cents"),
    "£": ("pound", "pounds", "penny", "pence"),
    "¥": ("yen", "yen", None, None),
    "₹": ("rupee", "rupees", "paisa", "paise"),
    "₩": ("won", "won", None, None),
}
_SCALE_ABBREVIATIONS = {"k": "thousand", "K": "thousand", "m": "million", "M": "million", "mn": "million",
                        "b": "billion", "B": "billion", "bn": "billion", "tn": "trillion"}

# unit after a number: (singular, plural). Case-sensitive; ambiguous short
# forms ("in", "s", "A", "t") are left out on purpose.
UNITS: dict[str, tuple[str, str]] = {
    "mm": ("millimeter", "millimeters"), "cm": ("centimeter", "centimeters"), "m": ("meter", "meters"),
    "km": ("kilometer", "kilometers"), "ft": ("foot", "feet"), "yd": ("yard", "yards"),
    "mi": ("mile", "miles"), "mg": ("milligram", "milligrams"), "g": ("gram", "grams"),
    "kg": ("kilogram", "kilograms"), "lb": ("pound", "pounds"), "lbs": ("pound", "pounds"),
    "oz": ("ounce", "ounces"), "ml": ("milliliter", "milliliters"), "mL": ("milliliter", "milliliters"),
    "L": ("liter", "liters"), "ms": ("millisecond", "milliseconds"), "sec": ("second", "seconds"),
    "min": ("minute", "minutes"), "h": ("hour", "hours"), "hr": ("hour", "hours"), "hrs": ("hour", "hours"),
    "km/h": ("kilometer per hour", "kilometers per hour"),
    "kph": ("kilometer per hour", "kilometers per hour"),
    "mph": ("mile per hour", "miles per hour"), "m/s": ("meter per second", "meters per second"),
    "Hz": ("hertz", "hertz"), "kHz": ("kilohertz", "kilohertz"), "MHz": ("megahertz", "megahertz"),
    "GHz": ("gigahertz", "gigahertz"), "W": ("watt", "watts"), "kW": ("kilowatt", "kilowatts"),
    "MW": ("megawatt", "megawatts"), "kWh": ("kilowatt hour", "kilowatt hours"), "V": ("volt", "volts"),
    "mA": ("milliamp", "milliamps"), "mAh": ("milliamp hour", "milliamp hours"),
    "KB": ("kilobyte", "kilobytes"), "kB": ("kilobyte", "kilobytes"), "MB": ("megabyte", "megabytes"),
    "GB": ("gigabyte", "gigabytes"), "TB": ("terabyte", "terabytes"),
    "°C": ("degree Celsius", "degrees Celsius"), "℃": ("degree Celsius", "degrees Celsius"),
    "°F": ("degree Fahrenheit", "degrees Fahrenheit"), "°": ("degree", "degrees"),
    "USD": ("US dollar", "US dollars"), "EUR": ("euro", "euros"), "GBP": ("pound", "pounds"),
}

# abbreviation: (expansion, whether it may end a sentence, so its period is
# kept when the text ends or a capitalised word follows).
ABBREVIATIONS: dict[str, tuple[str, bool]] = {
    "Mr.": ("mister", False), "Mrs.": ("missus", False), "Ms.": ("miz", False), "Dr.": ("doctor", False),
    "Prof.": ("professor", False), "Mt.": ("mount", False), "Capt.": ("captain", False),
    "Gen.": ("general", False), "Lt.": ("lieutenant", False), "Sgt.": ("sergeant", False),
    "vs.": ("versus", False), "e.g.": ("for example", False), "i.e.": ("that is", False),
    "approx.": ("approximately", False), "Jr.": ("junior", True), "Sr.": ("senior", True),
    "etc.": ("et cetera", True), "Inc.": ("incorporated", True), "Ltd.": ("limited", True),
    "Corp.": ("corporation", True), "Co.": ("company", True), "Ave.": ("avenue", True),
}

MONTHS = (
    "January", "February", "March", "April", "May", "June",
    "July", "August", "September", "October", "November", "December",
)
_MONTH_ABBREVIATIONS = {m[:3]: m for m in MONTHS} | {"Sept": "September"}
_MONTH = f"(?:{alternation(MONTHS)}|(?:{alternation(_MONTH_ABBREVIATIONS)})\\.?)"
_DAY = r"(?:[12]\d|3[01]|0?[1-9])"

_SYMBOLS = {"&": " and ", "@": " at ", "=": " equals ", "×": " times ", "½": " one half ",
            "¼": " one quarter ", "¾": " three quarters ", "%": " percent ", "№": " number "}
_SPECIAL_STRINGS = {"24/7": "twenty-four seven", "9/11": "nine eleven", "50/50": "fifty fifty"}

_YEAR_CONTEXT = (r"(?i:in|since|from|until|till|by|before|after|during|of|circa|year|spring|summer|autumn"
                 r"|fall|winter|early|late|mid-?)")


def _month(name: str) -> str:
    name = name.rstrip(".")
    return _MONTH_ABBREVIATIONS.get(name, name)


def _keeps_period(m: re.Match[str]) -> bool:
    """The abbreviation's period also ends the sentence."""
    rest = m.string[m.end():]
    return not rest.strip() or bool(re.match(r"\s+[A-Z\"“]", rest))


def _abbreviation(m: re.Match[str]) -> str:
    key = m.group(0)
    expansion, may_end = ABBREVIATIONS[key]
    return expansion + ("." if may_end and _keeps_period(m) else "")


def _saint_or_street(m: re.Match[str]) -> str:
    rest = m.string[m.end():]
    if re.match(r"\s+[A-Z]", rest):
        return "saint"
    return "street" + ("." if _keeps_period(m) else "")


def _money(m: re.Match[str]) -> str:
    one, many, sub_one, sub_many = _CURRENCIES[m["cur"]]
    sign = "minus " if m["sign"] else ""
    num = m["num"].replace(",", "")
    scale = m["scale"] or _SCALE_ABBREVIATIONS.get(m["abbr"] or "")
    if scale:
        return f"{sign}{en.number(num)} {scale} {many}"
    integer, _, cents = num.partition(".")
    if cents and (len(cents) != 2 or sub_one is None or sub_many is None):
        return f"{sign}{en.decimal(num)} {many}"
    units, subunits = int(integer), int(cents or 0)
    parts = []
    if units or not subunits:
        parts.append(f"{en.cardinal(units)} {one if units == 1 else many}")
    if subunits:
        parts.append(f"{en.cardinal(subunits)} {sub_one if subunits == 1 else sub_many}")
    return sign + " and ".join(parts)


def _measure(m: re.Match[str]) -> str:
    one, many = UNITS[m["unit"]]
    num = m["num"]
    return f"{en.number(num)} {one if num in ('1', '-1') else many}"


def _ampm(text: str | None) -> str:
    return "" if not text else (" a m" if text[0] in "aA" else " p m")


def _clock(m: re.Match[str]) -> str:
    hour, minute = int(m["h"]), int(m["m"])
    words = en.cardinal(hour)
    if minute == 0:
        words += "" if m["ap"] else " o'clock"
    elif minute < 10:
        words += f" oh {en.cardinal(minute)}"
    else:
        words += f" {en.cardinal(minute)}"
    if m["s"] and int(m["s"]):
        words += f" and {en.cardinal(int(m['s']))} seconds"
    return words + _ampm(m["ap"]) + ("." if m["dot"] and _keeps_period(m) else "")


def _hour_ampm(m: re.Match[str]) -> str:
    return en.cardinal(int(m["h"])) + _ampm(m["ap"]) + ("." if m["dot"] and _keeps_period(m) else "")


def _date_words(month: int, day: int, year: str | None) -> str:
    words = f"{MONTHS[month - 1]} {en.ordinal(day)}"
    return f"{words}, {en.year(int(year))}" if year else words


def _iso_date(m: re.Match[str]) -> str:
    month, day = int(m["a"]), int(m["b"])
    if not 1 <= month <= 12 or not 1 <= day <= 31:
        return m.group(0)
    return _date_words(month, day, m["y"])


def _slash_date(m: re.Match[str]) -> str:
    # m/d/y, or d/m/y when the first number cannot be a month
    a, b = int(m["a"]), int(m["b"])
    month, day = (a, b) if a <= 12 else (b, a)
    if not 1 <= month <= 12 or not 1 <= day <= 31:
        return m.group(0)
    return _date_words(month, day, m["y"])


def _year_range(m: re.Match[str]) -> str:
    return f"{en.year(int(m['a']))} to {en.year(int(m['b']))}"


def _range(m: re.Match[str]) -> str:
    a, b = m["a"], m["b"]
    if float(a) >= float(b):
        return m.group(0)
    return spaced(m, f"{en.number(a)} to {en.number(b)}")


def _digit_groups(m: re.Match[str]) -> str:
    return ", ".join(en.digits(g) for g in m.group(0).split("-"))


def _numeral(m: re.Match[str]) -> str:
    s = m.group(0)
    plain = s.replace(",", "")
    if ("." not in plain and len(plain) > 1 and plain.startswith("0")) or len(plain) > 36:
        return spaced(m, en.digits(plain))
    return spaced(m, en.number(s))


RULES: tuple[Rule, ...] = (
    rule("special_strings", f"(?<![\\w/])(?:{alternation(_SPECIAL_STRINGS)})(?![\\w/])",
         lambda m: _SPECIAL_STRINGS[m.group(0)]),
    rule("number_sign", r"(?<![\w.])(?:No|no|NO)\.\s?(?=\d)|#(?=\d)", lambda m: "number "),
    rule("saint_street", r"(?<![\w.])St\.", _saint_or_street),
    rule("abbreviations", f"(?<![\\w.])(?:{alternation(ABBREVIATIONS)})", _abbreviation),
    rule("money", f"(?P<sign>-)?(?P<cur>{alternation(_CURRENCIES)})\\s?(?P<num>{NUM})"
                  r"(?:\s?(?P<scale>thousand|million|billion|trillion)\b|(?P<abbr>mn|bn|tn|[kKmMbB])(?![\w]))?",
         _money),
    rule("percent", f"(?<![\\w.])(?P<num>-?{NUM})\\s?[%％]",
         lambda m: f"{en.number(m['num'])} percent"),
    rule("measure", f"(?<![\\w.])(?P<num>-?{NUM})\\s?(?P<unit>{alternation(UNITS)})(?![A-Za-z0-9])",
         _measure),
    rule("clock", r"(?<![\d:.])(?P<h>[01]?\d|2[0-3]):(?P<m>[0-5]\d)(?::(?P<s>[0-5]\d))?(?![\d:])"
                  r"(?:\s?(?P<ap>[AaPp]\.?[Mm])\b(?P<dot>\.)?)?", _clock),
    rule("hour_ampm", r"(?<![\w.:])(?P<h>1[0-2]|0?[1-9])\s?(?P<ap>[AaPp]\.?[Mm])\b(?P<dot>\.)?", _hour_ampm),
    rule("month_day", f"(?<!\\w)(?P<mon>{_MONTH})\\s+(?P<d>{_DAY})(?:st|nd|rd|th)?\\b"
                      r"(?:,?\s+(?P<y>\d{4})\b)?",
         lambda m: _date_words(MONTHS.index(_month(m["mon"])) + 1, int(m["d"]), m["y"])),
    rule("day_month", f"(?<![\\w.])(?P<d>{_DAY})(?:st|nd|rd|th)?\\s+(?:of\\s+)?(?P<mon>{_MONTH})(?!\\w)"
                      r"(?:,?\s+(?P<y>\d{4})\b)?",
         lambda m: f"the {en.ordinal(int(m['d']))} of {_month(m['mon'])}"
                   + (f" {en.year(int(m['y']))}" if m["y"] else "")),
    rule("iso_date", r"(?<![\w./-])(?P<y>\d{4})-(?P<a>\d{1,2})-(?P<b>\d{1,2})(?![\w/-])", _iso_date),
    rule("slash_date", r"(?<![\w./-])(?P<a>\d{1,2})/(?P<b>\d{1,2})/(?P<y>\d{4})(?![\w/-])", _slash_date),
    rule("decades", r"(?<![\w'])(?P<y>1\d{2}0|20\d0)s\b", lambda m: en.plural(en.year(int(m["y"])))),
    rule("short_decades", r"['‘’](?P<d>[2-9]0)s\b", lambda m: en.plural(en.cardinal(int(m["d"])))),
    rule("era", r"(?<![\w.])(?P<y>\d{1,4})\s?(?P<era>BCE|BC|CE|AD)\b",
         lambda m: f"{en.year(int(m['y']))} {' '.join(m['era'])}"),
    rule("year_range", r"(?<![\w.,-])(?P<a>1[1-9]\d\d|20\d\d)\s?[-–]\s?(?P<b>1[1-9]\d\d|20\d\d)"
                       r"(?![\w-]|[.,]\d)",
         _year_range),
    rule("year_after_context", f"\\b(?P<ctx>{_YEAR_CONTEXT})\\s+(?P<y>1\\d{{3}}|20\\d\\d)(?!\\w|[.,]\\d)",
         lambda m: f"{m['ctx']} {en.year(int(m['y']))}"),
    rule("bare_year", r"(?<![\w.,$€£¥-])(?P<y>19\d\d|20\d\d)(?!\w|[.,]\d|-\d)",
         lambda m: en.year(int(m["y"]))),
    rule("ordinal", r"(?<![\w.])(?P<n>\d+)(?:st|nd|rd|th|ST|ND|RD|TH)\b", lambda m: en.ordinal(int(m["n"]))),
    rule("fraction", r"(?<![\w./])(?P<a>\d+)/(?P<b>\d+)(?![\w/]|\.\d)",
         lambda m: en.fraction(int(m["a"]), int(m["b"]))),
    rule("digit_groups", r"(?<![\w.-])\d{3}-\d{3,4}(?:-\d{4})?(?![\w-])", _digit_groups),
    rule("range", r"(?<![\w.,-])(?P<a>[1-9]\d{0,3}(?:\.\d+)?)\s?[-–~]\s?(?P<b>[1-9]\d{0,3}(?:\.\d+)?)"
                  r"(?![\w-]|\.\d)",
         _range),
    rule("negative", r"(?<![\w.,])[-−](?=\d)", lambda m: "minus "),
    rule("plus", r"\+(?=\s?\d)|(?<=\d)\s?\+|(?<=\s)\+(?=\s)", lambda m: " plus "),
    rule("symbols", alternation(_SYMBOLS), lambda m: _SYMBOLS[m.group(0)]),
    rule("numeral", r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+|(?<![\w.])\.\d+|\d+)", _numeral),
    rule("spaces", r"[ \t]{2,}", lambda m: " "),
    rule("space_before_punctuation", r" +(?=[,.!?;:])", lambda m: ""),
)


def normalize_english(text: str) -> str:
    """Apply the English rules to plain text (no special tokens in it).
    Leading and trailing spaces are kept (they separate it from its
    neighbours)."""
    for r in RULES:
        text = r.apply(text)
    return text
