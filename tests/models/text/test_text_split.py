"""split_paragraph / is_only_punctuation against upstream's functions
(cosyvoice.utils.frontend_utils, from the pinned reference package)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from cosyedge_models.text.split import SplitSettings, is_only_punctuation, split_paragraph, split_with
from cosyedge_models.text.tokenizer import TextTokenizer

from tests.support.components import require_module

upstream = require_module("cosyvoice.utils.frontend_utils")

ZH = [
    "收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐，笑容如花儿般绽放。",
    "今天天气很好。我们去公园吧！你想去吗？好的；那就走：出发、前进",
    "他说：“我们走吧。”然后就离开了。她回答：“好！”",
    "在他讲述那个荒诞故事的过程中，他突然[laughter]停下来，因为他自己也被逗笑了[laughter]。" * 3,
    "一" * 150 + "。" + "二" * 30 + "！" + "三" * 10 + "？",
    "短句。" * 40,
    "我们用CosyVoice合成语音，效果很好.速度也快?真的!",
    "没有标点的一段很长的文字" * 12,
    "what?!真的吗?!太好了……是的。。。好",
]
EN = [
    "Hello world. This is a test of the splitter! Does it work? Yes; it does: mostly.",
    'He said "stop." Then he left. She asked "why?" Nobody knew.',
    "The quick brown fox jumps over the lazy dog. " * 12,
    "A very long sentence without any sentence marks but with commas, many commas, and more words, "
    "going on and on, as long sentences do, until the reader gets tired, and then some more, " * 3,
    "Wait... what?! Really?! Okay.",
    "Short. Short. Short. Short. Short. Short. Short. Short. Short. A longer closing sentence to end it all",
    "One sentence only",
    "Numbers like three point five are fine. So are [breath] special tokens. <strong>Really</strong>.",
]
SENTENCES_ZH = [
    "今天天气很好",
    "我们一起去公园散步吧",
    "收到好友从远方寄来的生日礼物",
    "那份意外的惊喜",
    "好",
    "CosyVoice是一个模型",
    "他说“走吧”",
    "一二三四五六七八九十" * 3,
]
SENTENCES_EN = [
    "Hello world",
    "this is fine",
    "The quick brown fox jumps over the lazy dog",
    "Yes",
    "we will see what happens when the text gets longer and longer",
    'he said "hi',
    "ok",
]
MARKS_ZH = ["。", "？", "！", "；", "：", "、", "，", ".", "?", "!", "!!", "。”", '."', ""]
MARKS_EN = [".", "?", "!", ";", ":", ",", "...", '."', "?”", "", " "]


def _random_paragraphs(seed: int, sentences: list[str], marks: list[str], n: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(1, 25)
        out.append("".join(rng.choice(sentences) + rng.choice(marks) for _ in range(k)).strip() or "x")
    return out


def _check_same(text: str, tokenize: Callable[[str], list[int]], lang: str, **kw: object) -> None:
    ours = split_paragraph(text, tokenize, lang, **kw)  # type: ignore[arg-type]
    theirs = upstream.split_paragraph(text, tokenize, lang, **kw)
    assert ours == theirs, (text, ours, theirs)


@pytest.mark.parametrize("text", ZH + EN)
@pytest.mark.parametrize("lang", ["zh", "en"])
def test_matches_upstream_on_corpus(text_tokenizer: TextTokenizer, text: str, lang: str) -> None:
    _check_same(text, text_tokenizer.encode, lang)


def test_matches_upstream_on_random_paragraphs(text_tokenizer: TextTokenizer) -> None:
    for text in _random_paragraphs(1, SENTENCES_ZH, MARKS_ZH, 150):
        _check_same(text, text_tokenizer.encode, "zh")
    for text in _random_paragraphs(2, SENTENCES_EN, MARKS_EN, 150):
        _check_same(text, text_tokenizer.encode, "en")
    mixed = _random_paragraphs(3, SENTENCES_ZH + SENTENCES_EN, MARKS_ZH + MARKS_EN, 100)
    for text in mixed:
        _check_same(text, text_tokenizer.encode, "zh")
        _check_same(text, text_tokenizer.encode, "en")


@pytest.mark.parametrize(
    "kw",
    [
        {"comma_split": True},
        {"token_max_n": 30, "token_min_n": 10, "merge_len": 5},
        {"token_max_n": 200, "token_min_n": 150, "merge_len": 40},
    ],
)
def test_matches_upstream_with_other_settings(text_tokenizer: TextTokenizer, kw: dict[str, object]) -> None:
    for text in ZH + _random_paragraphs(4, SENTENCES_ZH, MARKS_ZH, 40):
        _check_same(text, text_tokenizer.encode, "zh", **kw)
    for text in EN + _random_paragraphs(5, SENTENCES_EN, MARKS_EN, 40):
        _check_same(text, text_tokenizer.encode, "en", **kw)


def test_where_upstream_raises() -> None:
    assert split_paragraph("", len, "zh") == []
    # upstream pops from an empty list here
    assert split_paragraph('."abc', list, "en") == ["abc."]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "。",
        "，。！？",
        "...",
        "!?",
        "“”",
        "——",
        "$%^&*",
        "[]",
        "。 ",
        "a",
        "好。",
        "1",
        "[breath]",
        "🎉",
        "～",
    ],
)
def test_is_only_punctuation_matches_upstream(text: str) -> None:
    assert is_only_punctuation(text) == upstream.is_only_punctuation(text)


def test_first_segment_is_short(text_tokenizer: TextTokenizer) -> None:
    text = ZH[0] + "我们明天再见。" + ZH[1] + ZH[2]
    base = split_paragraph(text, text_tokenizer.encode, "zh")
    quick = split_paragraph(text, text_tokenizer.encode, "zh", first_segment_max_n=20)
    assert "".join(quick) == "".join(base)  # nothing lost or reordered
    assert len(quick[0]) <= 20 and len(base[0]) > 20
    assert quick[0].endswith("，")  # cut after a pause mark
    # English, measured in tokens; short sentences are gathered up to the limit
    en = "Hi. " + "Okay. " * 3 + EN[2]
    segs = split_paragraph(en, text_tokenizer.encode, "en", first_segment_max_n=12)
    assert "".join(segs) == "".join(split_paragraph(en, text_tokenizer.encode, "en"))
    assert len(text_tokenizer.encode(segs[0])) <= 12
    assert segs[0].startswith("Hi.") and "Okay." in segs[0]
    # the short tail is not merged back into the quick first segment
    assert split_paragraph("一二三四五，六七。八。", len, "zh", first_segment_max_n=6) == [
        "一二三四五，",
        "六七。八。",
    ]
    # a first sentence without pause marks stays whole
    assert (
        split_paragraph("一二三四五六七八九十。好的。", len, "zh", first_segment_max_n=4)[0]
        == "一二三四五六七八九十。"
    )


def test_max_segment_caps_unpunctuated_text(text_tokenizer: TextTokenizer) -> None:
    text = ZH[7]  # 156 characters, no sentence marks
    assert len(split_paragraph(text, len, "zh")) == 1
    capped = split_paragraph(text, len, "zh", max_segment_n=50)
    assert all(len(s) <= 50 for s in capped) and "".join(capped) == text + "。"
    words = EN[3]
    capped_en = split_paragraph(words, text_tokenizer.encode, "en", max_segment_n=40)
    assert all(len(text_tokenizer.encode(s)) <= 40 for s in capped_en)
    assert "".join(capped_en) == words + "."
    # cut after commas, else at spaces; never inside a word
    assert all(s.endswith((",", " ")) for s in capped_en[:-1])
    assert sum(s.endswith(",") for s in capped_en) >= len(capped_en) // 2
    # merging never builds a segment over the cap
    merged = split_paragraph("一" * 45 + "。" + "二" * 45 + "。" + "三", len, "zh", max_segment_n=50)
    assert all(len(s) <= 50 for s in merged)


def test_settings_validation_and_split_with(text_tokenizer: TextTokenizer) -> None:
    with pytest.raises(ValueError, match="first_segment_max_n"):
        SplitSettings(first_segment_max_n=0)
    with pytest.raises(ValueError, match="token_max_n"):
        SplitSettings(token_max_n=-1)
    assert split_with(EN[0], text_tokenizer.encode, "en", SplitSettings()) == upstream.split_paragraph(
        EN[0], text_tokenizer.encode, "en"
    )


def test_other_scripts_split_on_full_width_marks(text_tokenizer: TextTokenizer) -> None:
    text = "こんにちは。げんきですか？はい、げんきです！Привет. Как дела?"
    segments = split_paragraph(
        text, text_tokenizer.encode, "other", token_max_n=5, token_min_n=1, merge_len=1
    )
    assert segments[:3] == ["こんにちは。", "げんきですか？", "はい、げんきです！"]
    assert "".join(segments) == text  # it already ends in a mark


def test_one_sentence_per_segment_in_characters() -> None:
    """The daemon's per-sentence streaming (espeak-ng) uses this splitter with no
    merging and a character cap: every sentence is its own segment."""
    def chars(s: str) -> range:
        return range(len(s))

    parts = split_paragraph("One. Two!  Three?\nFour", chars, "other", 0, 0, 0, max_segment_n=400)
    assert [p.strip() for p in parts] == ["One.", "Two!", "Three?", "Four."]
    long = split_paragraph("word " * 200, chars, "other", 0, 0, 0, max_segment_n=100)
    assert all(len(p) <= 100 for p in long) and "".join(long).split() == ["word"] * 200 + ["."]
