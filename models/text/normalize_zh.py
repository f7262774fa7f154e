"""Chinese text normalization rules: what upstream gets from wetext's Chinese
normalizer (`ZhNormalizer(remove_erhua=False, full_to_half=False)`),
approximated with regex rules and our own numerals (`numbers_zh`).

Covered, in this order: dates (2025-01-15 / 2025/1/15 / 2025.1.15 ->
二零二五年一月十五日; a four-digit number before 年 is read digit by digit),
times (12:30 -> 十二点三十分, 8:05:09 -> 八点零五分零九秒), percentages
(百分之五十, ‰ 千分之), money with a symbol (¥100 -> 一百元, $5 -> 五美元,
€ 欧元, £ 英镑), measures (a table of units: kg 千克, km/h 千米每小时, ℃ 摄氏度,
m² 平方米, ...), fractions (3/4 -> 四分之三), scores and ratios (3:2 -> 三比二),
ranges (3-5, 3~5 -> 三到五), negative numbers (负), and every remaining numeral
(cardinals with 万/亿, decimals with 点, leading-zero and 11+ digit strings such
as phone numbers digit by digit).

Not covered: 两 for 2 before measure words (we say 二), 幺 for 1 in phone
numbers, traditional -> simplified conversion and interjection removal (the
wetext defaults), English words and their numbers inside Chinese text (they
get Chinese numerals, like upstream), units not in the table.
"""

from __future__ import annotations

import re

import cosyedge_models.text.numbers_zh as zh
from cosyedge_models.text.rules import NUM, Rule, alternation, rule

_CURRENCIES = {"¥": "元", "￥": "元", "$": "美元", "US$": "美元", "€": "欧元", "£": "英镑", "₩": "韩元",
               "HK$": "港元", "₹": "卢比"}

UNITS: dict[str, str] = {
    "mm": "毫米", "cm": "厘米", "dm": "分米", "m": "米", "km": "千米", "mg": "毫克", "g": "克", "kg": "千克",
    "t": "吨", "ml": "毫升", "mL": "毫升", "L": "升", "l": "升", "ms": "毫秒", "s": "秒", "min": "分钟",
    "h": "小时", "km/h": "千米每小时", "m/s": "米每秒", "Hz": "赫兹", "kHz": "千赫兹", "MHz": "兆赫兹",
    "GHz": "吉赫兹", "W": "瓦", "kW": "千瓦", "kWh": "千瓦时", "V": "伏", "mA": "毫安", "mAh": "毫安时",
    "°C": "摄氏度", "℃": "摄氏度", "°F": "华氏度", "℉": "华氏度", "°": "度", "m²": "平方米", "㎡": "平方米",
    "km²": "平方千米", "cm²": "平方厘米", "m³": "立方米", "cm³": "立方厘米", "KB": "千字节", "MB": "兆字节",
    "GB": "吉字节", "TB": "太字节", "USD": "美元", "RMB": "元", "CNY": "元", "EUR": "欧元",
}

_NO_LATIN_BEFORE = r"(?<![0-9A-Za-z.])"
_NO_LATIN_AFTER = r"(?![0-9A-Za-z])"


def _date(m: re.Match[str]) -> str:
    month, day = int(m["m"]), int(m["d"])
    if not 1 <= month <= 12 or not 1 <= day <= 31:
        return m.group(0)
    return f"{zh.digits(m['y'])}年{zh.cardinal(month)}月{zh.cardinal(day)}日"


def _two_digits(value: str) -> str:
    """Minutes and seconds: '05' -> 零五, '30' -> 三十."""
    n = int(value)
    return f"零{zh.DIGITS[n]}" if value.startswith("0") and n else zh.cardinal(n)


def _clock(m: re.Match[str]) -> str:
    words = f"{zh.cardinal(int(m['h']))}点"
    if int(m["m"]) or (m["s"] and int(m["s"])):
        words += f"{_two_digits(m['m'])}分"
    if m["s"] and int(m["s"]):
        words += f"{_two_digits(m['s'])}秒"
    return words


def _money(m: re.Match[str]) -> str:
    return f"{zh.number(m['num'])}{m['scale'] or ''}{_CURRENCIES[m['cur']]}"


def _range(m: re.Match[str]) -> str:
    if float(m["a"]) >= float(m["b"]):
        return m.group(0)
    return f"{zh.number(m['a'])}到{zh.number(m['b'])}"


RULES: tuple[Rule, ...] = (
    rule("date", f"{_NO_LATIN_BEFORE}(?P<y>\\d{{4}})(?P<sep>[-/.])(?P<m>\\d{{1,2}})(?P=sep)(?P<d>\\d{{1,2}})"
                 f"{_NO_LATIN_AFTER}", _date),
    rule("year", f"{_NO_LATIN_BEFORE}(?P<y>\\d{{4}})(?=\\s?年)", lambda m: zh.digits(m["y"])),
    rule("clock", r"(?<![\d:：.])(?P<h>[01]?\d|2[0-3])[:：](?P<m>[0-5]\d)(?:[:：](?P<s>[0-5]\d))?(?![\d:：])",
         _clock),
    rule("percent", f"{_NO_LATIN_BEFORE}(?P<num>-?{NUM})\\s?(?P<sign>[%％‰])",
         lambda m: ("千分之" if m["sign"] == "‰" else "百分之") + zh.number(m["num"])),
    rule("money", f"(?P<cur>{alternation(_CURRENCIES)})\\s?(?P<num>{NUM})(?P<scale>[万亿]*)", _money),
    rule("measure", f"{_NO_LATIN_BEFORE}(?P<num>-?{NUM})\\s?(?P<unit>{alternation(UNITS)}){_NO_LATIN_AFTER}",
         lambda m: zh.number(m["num"]) + UNITS[m["unit"]]),
    rule("fraction", r"(?<![\d/.])(?P<a>\d+)/(?P<b>\d+)(?![\d/]|\.\d)",
         lambda m: zh.fraction(m["a"], m["b"])),
    rule("ratio", r"(?<![\d:：.])(?P<a>\d+)[:：](?P<b>\d+)(?![\d:：]|\.\d)",
         lambda m: f"{zh.number(m['a'])}比{zh.number(m['b'])}"),
    rule("range", r"(?<![\d.,-])(?P<a>[1-9]\d{0,3}(?:\.\d+)?)\s?[-–~～]\s?(?P<b>[1-9]\d{0,3}(?:\.\d+)?)"
                  r"(?![\d-]|\.\d)",
         _range),
    rule("negative", f"{_NO_LATIN_BEFORE}[-−](?=\\d)", lambda m: "负"),
    rule("numeral", r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+|\d+)", lambda m: zh.number(m.group(0))),
)


def normalize_chinese(text: str) -> str:
    """Apply the Chinese rules to plain text (no special tokens in it)."""
    for r in RULES:
        text = r.apply(text)
    return text
