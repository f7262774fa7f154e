"""Text normalization: number words (checked against inflect and a Chinese
numeral parser written here), the English and Chinese rule tables, upstream's
punctuation helpers (against cosyvoice.utils.frontend_utils) and language
detection."""

from __future__ import annotations

import random

import cosyedge_models.text.numbers_en as numbers_en
import cosyedge_models.text.numbers_zh as numbers_zh
import pytest
from cosyedge_models.text.normalize import (
    clean_characters,
    contains_chinese,
    detect_language,
    normalize_text,
    remove_bracket,
    replace_blank,
    replace_corner_mark,
)
from cosyedge_models.text.normalize_en import RULES as EN_RULES
from cosyedge_models.text.normalize_zh import RULES as ZH_RULES

from tests.support.components import require_module

# --- English number words -------------------------------------------------------


def test_cardinal_matches_inflect() -> None:
    inflect = require_module("inflect")
    engine = inflect.engine()
    rng = random.Random(0)
    numbers = list(range(0, 1200)) + [rng.randrange(10 ** rng.randint(4, 30)) for _ in range(400)]
    for n in numbers:
        expected = engine.number_to_words(n, andword="").replace(",", "")
        assert numbers_en.cardinal(n) == expected, n


def test_ordinal_matches_inflect() -> None:
    inflect = require_module("inflect")
    engine = inflect.engine()
    for n in list(range(1, 400)) + [1000, 1001, 1012, 20_000, 1_000_000, 123_456_789]:
        expected = engine.ordinal(engine.number_to_words(n, andword="")).replace(",", "")
        assert numbers_en.ordinal(n) == expected, n


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (1990, "nineteen ninety"),
        (1905, "nineteen oh five"),
        (2000, "two thousand"),
        (2007, "two thousand seven"),
        (2010, "twenty ten"),
        (2025, "twenty twenty-five"),
        (1900, "nineteen hundred"),
        (1066, "ten sixty-six"),
        (3000, "three thousand"),
        (999, "nine hundred ninety-nine"),
    ],
)
def test_year(value: int, words: str) -> None:
    assert numbers_en.year(value) == words


def test_en_misc_words() -> None:
    assert numbers_en.decimal("3.14") == "three point one four"
    assert numbers_en.decimal(".5") == "point five"
    assert numbers_en.number("-2") == "minus two"
    assert numbers_en.number("1,234.50") == "one thousand two hundred thirty-four point five zero"
    assert numbers_en.digits("007") == "zero zero seven"
    assert numbers_en.fraction(1, 2) == "one half"
    assert numbers_en.fraction(3, 2) == "three halves"
    assert numbers_en.fraction(3, 4) == "three quarters"
    assert numbers_en.fraction(5, 8) == "five eighths"
    assert numbers_en.fraction(1, 3) == "one third"
    assert numbers_en.fraction(7, 1000) == "seven over one thousand"
    assert numbers_en.plural(numbers_en.year(1990)) == "nineteen nineties"
    assert numbers_en.cardinal(10**40) == numbers_en.digits(str(10**40))


# --- Chinese numerals ------------------------------------------------------------

_ZH_DIGIT = {c: i for i, c in enumerate("零一二三四五六七八九")}
_ZH_PLACE = {"十": 10, "百": 100, "千": 1000}


def _parse_zh(text: str) -> int:
    """Chinese numeral -> int, written independently of numbers_zh."""

    def below_10000(s: str) -> int:
        total, digit = 0, None
        for c in s:
            if c in _ZH_DIGIT:
                digit = _ZH_DIGIT[c]
            else:
                total += (1 if digit is None else digit) * _ZH_PLACE[c]
                digit = None
        return total + (digit or 0)

    total = 0
    for unit, scale in (("万亿", 10**12), ("亿", 10**8), ("万", 10**4)):
        if unit in text:
            head, text = text.split(unit, 1)
            total += _parse_zh(head) * scale
    return total + below_10000(text)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (0, "零"),
        (10, "十"),
        (15, "十五"),
        (20, "二十"),
        (100, "一百"),
        (101, "一百零一"),
        (110, "一百一十"),
        (1001, "一千零一"),
        (1010, "一千零一十"),
        (10000, "一万"),
        (10010, "一万零一十"),
        (100000, "十万"),
        (100001, "十万零一"),
        (1000000, "一百万"),
        (100000000, "一亿"),
        (100010000, "一亿零一万"),
        (120000000, "一亿二千万"),
        (2025, "二千零二十五"),
        (-5, "负五"),
        (1_0000_0000_0000, "一万亿"),
    ],
)
def test_zh_cardinal_table(value: int, words: str) -> None:
    assert numbers_zh.cardinal(value) == words


def test_zh_cardinal_roundtrip() -> None:
    rng = random.Random(1)
    for n in list(range(0, 3000)) + [rng.randrange(10 ** rng.randint(4, 16)) for _ in range(3000)]:
        words = numbers_zh.cardinal(n)
        assert _parse_zh(words) == n, (n, words)
        assert "零零" not in words and not words.endswith("零") or n == 0


def test_zh_misc() -> None:
    assert numbers_zh.digits("2025") == "二零二五"
    assert numbers_zh.decimal("3.05") == "三点零五"
    assert numbers_zh.decimal("0.5") == "零点五"
    assert numbers_zh.number("13812345678") == "一三八一二三四五六七八"
    assert numbers_zh.number("007") == "零零七"
    assert numbers_zh.number("1,000") == "一千"
    assert numbers_zh.fraction("3", "4") == "四分之三"


# --- the rule tables ---------------------------------------------------------------

EN_CASES = [
    (
        "Dr. Smith paid $5.20 for 3 apples.",
        "doctor Smith paid five dollars and twenty cents for three apples.",
    ),
    ("It costs $1, €3bn or £0.50.", "It costs one dollar, three billion euros or fifty pence."),
    ("$2.5 million", "two point five million dollars"),
    ("Prices rose 50% and 3.5%.", "Prices rose fifty percent and three point five percent."),
    (
        "We walked 3.5 km and 1 mi with 2 kg.",
        "We walked three point five kilometers and one mile with two kilograms.",
    ),
    ("It was 5°C, or 41 °F.", "It was five degrees Celsius, or forty-one degrees Fahrenheit."),
    ("Meet at 10:30 am or 7:05.", "Meet at ten thirty a m or seven oh five."),
    ("At 10:00 we start.", "At ten o'clock we start."),
    ("Come at 5 p.m. Then eat.", "Come at five p m. Then eat."),
    ("Born on January 5, 2025 here.", "Born on January fifth, twenty twenty-five here."),
    ("On 5 May 2020 it rained.", "On the fifth of May twenty twenty it rained."),
    (
        "Due 2025-01-15 or 1/15/2025.",
        "Due January fifteenth, twenty twenty-five or January fifteenth, twenty twenty-five.",
    ),
    ("The 1990s and the '80s.", "The nineteen nineties and the eighties."),
    (
        "In 1066 and by 1850, then 1999 and 2024.",
        "In ten sixty-six and by eighteen fifty, then nineteen ninety-nine and twenty twenty-four.",
    ),
    ("From 1990-2000.", "From nineteen ninety to two thousand."),
    ("The 1st, 2nd, 3rd and 22nd.", "The first, second, third and twenty-second."),
    ("Add 1/2 cup and 3/4 spoon, 24/7.", "Add one half cup and three quarters spoon, twenty-four seven."),
    ("Call 555-1234 now.", "Call five five five, one two three four now."),
    ("Pages 10-20 and -5 degrees.", "Pages ten to twenty and minus five degrees."),
    ("Tom & Jerry, No. 5 and #3.", "Tom and Jerry, number five and number three."),
    ("1,234,567 people", "one million two hundred thirty-four thousand five hundred sixty-seven people"),
    ("An mp3 of CosyVoice2 with 0.5B params.", "An mp three of CosyVoice two with zero point five B params."),
    ("Agent 007 has 1500 rounds.", "Agent zero zero seven has one thousand five hundred rounds."),
    ("Apples, pears etc. Then more.", "Apples, pears et cetera. Then more."),
    (
        "Mr. and Mrs. Lee vs. Ms. Park, e.g. today.",
        "mister and missus Lee versus miz Park, for example today.",
    ),
    ("Main St. is near St. Paul.", "Main street is near saint Paul."),
    ("2 + 2 = 4", "two plus two equals four"),
    ("No numbers here.", "No numbers here."),
]


@pytest.mark.parametrize(("text", "expected"), EN_CASES)
def test_english(text: str, expected: str) -> None:
    assert normalize_text(text, "en") == (expected, "en")


ZH_CASES = [
    ("2025年1月15日", "二零二五年一月十五日"),
    ("会议在2025-01-15举行", "会议在二零二五年一月十五日举行"),
    ("气温3.5℃", "气温三点五摄氏度。"[:-1]),
    ("一共100人，花了10010元", "一共一百人，花了一万零一十元"),
    ("现在是12:30，8:05:09开始", "现在是十二点三十分，八点零五分零九秒开始"),
    ("比分3:2", "比分三比二"),
    ("增长了50%，千分之5用‰表示为5‰", "增长了百分之五十，千分之五用‰表示为千分之五"),
    ("价格¥100，约$15", "价格一百元，约十五美元"),
    ("跑了5km，重2.5kg，面积100m²", "跑了五千米，重二点五千克，面积一百平方米"),
    ("3/4的人", "四分之三的人"),
    ("需要3-5天或3~5天", "需要三到五天或三到五天"),
    ("零下-5度", "零下负五度"),
    ("电话13812345678", "电话一三八一二三四五六七八"),
    ("第3名", "第三名"),
    ("有1,000个", "有一千个"),
]


@pytest.mark.parametrize(("text", "expected"), ZH_CASES)
def test_chinese(text: str, expected: str) -> None:
    assert normalize_text(text, "zh") == (expected, "zh")


def test_chinese_punctuation_rules() -> None:
    # upstream's post-TN rules: newline removed, blanks, corner marks, '.', ' - ', brackets, trailing comma
    assert normalize_text("你好 世界\n再见.", "zh")[0] == "你好世界再见。"
    assert normalize_text("我们用 CosyVoice 合成", "zh")[0] == "我们用CosyVoice合成"
    assert normalize_text("hello - world 好", "zh")[0] == "hello，world好"
    assert normalize_text("今天（星期一）【重要】——好", "zh")[0] == "今天星期一重要 好"
    assert normalize_text("你好，、", "zh")[0] == "你好。"
    assert normalize_text("x²和y³", "zh")[0] == "x平方和y立方"


def test_special_tokens_pass_through() -> None:
    text = "他突然[laughter]停下来 [breath] <strong>3</strong>个"
    # (replace_blank keeps a space between two ASCII characters, as upstream)
    assert normalize_text(text)[0] == "他突然[laughter]停下来[breath] <strong>三</strong>个"
    assert normalize_text("I [breath] paid $3 [laughter].")[0] == "I [breath] paid three dollars [laughter]."
    # an unknown bracketed word is just text
    assert normalize_text("[foo] 3")[0] == "[foo] three"


def test_markup_skips_frontend() -> None:
    text = "  用四川话说<|endofprompt|>今天是2025年  "
    assert normalize_text(text) == (text, "zh")


def test_other_scripts_pass_through() -> None:
    assert normalize_text("Привет,   мир! 2025 год.") == ("Привет, мир! 2025 год.", "other")
    assert normalize_text("안녕하세요 ３개") == ("안녕하세요 3개", "other")
    assert normalize_text("こんにちは。", "auto")[1] == "other"
    assert normalize_text("東京へ行く", "auto")[1] == "zh"  # kanji: as upstream's contains_chinese


def test_full_width_and_cleaning() -> None:
    assert normalize_text("Ｈｅｌｌｏ，ｗｏｒｌｄ！ １２") == ("Hello, world! twelve", "en")
    assert normalize_text("价格１２３元")[0] == "价格一百二十三元"
    assert clean_characters("a\u200bb\ufeff\tc\r\nd\x07e\u3000f") == "ab c\nde f"
    assert (
        normalize_text("Title line\nNext line\ncontinues here.", "en")[0]
        == "Title line. Next line continues here."
    )


def test_language_detection() -> None:
    assert detect_language("Hello") == "en"
    assert detect_language("12345 !!") == "en"
    assert detect_language("Grüße aus München") == "en"
    assert detect_language("Hello 世界") == "zh"
    assert detect_language("Привет мир") == "other"
    with pytest.raises(ValueError, match="auto, zh, en, other"):
        normalize_text("x", "fr")


@pytest.mark.parametrize(
    "text",
    ["你好 世界", "a b c", "中 a b 文", "hello  world", "你 好", "x - y", "中 文 a", "a  b", "1 2 好 3"],
)
def test_helpers_match_upstream(text: str) -> None:
    upstream = require_module("cosyvoice.utils.frontend_utils")
    assert replace_blank(text) == upstream.replace_blank(text)
    assert contains_chinese(text) == upstream.contains_chinese(text)
    for sample in ("x²", "（a）【b】`c`——d", text):
        assert replace_corner_mark(sample) == upstream.replace_corner_mark(sample)
        assert remove_bracket(sample) == upstream.remove_bracket(sample)


def test_replace_blank_at_the_ends() -> None:
    # upstream indexes past the end here (it only sees stripped text); we drop the space
    assert replace_blank(" a b ") == "a b"


def test_rule_names_unique() -> None:
    for rules in (EN_RULES, ZH_RULES):
        names = [r.name for r in rules]
        assert len(names) == len(set(names))
