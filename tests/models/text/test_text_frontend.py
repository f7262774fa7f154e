"""TextFrontend: request text -> normalized, split, tokenized segments, and
the RequestError codes for bad text."""

from __future__ import annotations

import numpy as np
import pytest
from cosyedge_models.errors import RequestError
from cosyedge_models.text.frontend import TextFrontend
from cosyedge_models.text.normalize import normalize_text
from cosyedge_models.text.split import SplitSettings, split_paragraph
from cosyedge_models.text.tokenizer import END_OF_PROMPT, TextTokenizer

LONG_ZH = (
    "收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐，笑容如花儿般绽放。"
    "在他讲述那个荒诞故事的过程中，他突然[laughter]停下来，因为他自己也被逗笑了[laughter]。"
    "今天是2025年1月15日，气温3.5℃，一共有100人参加。"
)


@pytest.fixture()
def frontend(text_tokenizer: TextTokenizer) -> TextFrontend:
    return TextFrontend(text_tokenizer, max_text_chars=500)


def test_segments_are_upstream_text_normalize(frontend: TextFrontend, text_tokenizer: TextTokenizer) -> None:
    segments = frontend.prepare(LONG_ZH)
    normalized, lang = normalize_text(LONG_ZH)
    assert lang == "zh"
    # upstream: split_paragraph on the normalized text, punctuation-only pieces dropped
    assert [s.text for s in segments] == split_paragraph(normalized, text_tokenizer.encode, "zh")
    assert len(segments) > 1
    for s in segments:
        assert s.token_ids.dtype == np.int64 and s.token_ids.ndim == 1
        assert s.token_ids.tolist() == text_tokenizer.encode(s.text)
        assert s.language == "zh"
    assert "二零二五年一月十五日" in "".join(s.text for s in segments)
    assert any(text_tokenizer.token_to_id("[laughter]") in s.token_ids for s in segments)


def test_english_segments(frontend: TextFrontend) -> None:
    segments = frontend.prepare("Dr. Smith paid $5 on May 3rd. He was happy!")
    assert [s.text for s in segments] == ["doctor Smith paid five dollars on May third. He was happy!"]
    assert segments[0].language == "en"


def test_punctuation_only_pieces_are_dropped(frontend: TextFrontend) -> None:
    segments = frontend.prepare("你好。" + "，" * 3 + "！！")
    assert all(any(c.isalnum() for c in s.text) for s in segments)


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("", "empty_text"),
        ("   \n\t ", "empty_text"),
        ("x" * 501, "text_too_long"),
        ("hello\x07world", "invalid_text"),
        ("bad \x1b[31m escape", "invalid_text"),
        ("surrogate \ud800 here", "invalid_text"),
        ("。。。！？", "no_speakable_text"),
        ("*^|~", "no_speakable_text"),
        (None, "invalid_text"),
        (42, "invalid_text"),
    ],
)
def test_bad_text(frontend: TextFrontend, text: object, code: str) -> None:
    with pytest.raises(RequestError) as info:
        frontend.prepare(text)  # type: ignore[arg-type]
    assert info.value.code == code
    assert str(info.value)  # a message for the user


def test_error_messages_say_what_is_expected(frontend: TextFrontend) -> None:
    with pytest.raises(RequestError, match="501 characters; the limit is 500"):
        frontend.prepare("x" * 501)
    with pytest.raises(RequestError, match="U\\+0007 at position 5"):
        frontend.prepare("hello\x07")
    # tab, CR and LF are fine
    assert frontend.prepare("hello\tworld\r\nagain")


def test_instruct(frontend: TextFrontend, text_tokenizer: TextTokenizer) -> None:
    ids = frontend.prepare_instruct("用四川话说这句话")
    # upstream instruct2: instruct_text + '<|endofprompt|>', not normalized
    assert ids.tolist() == text_tokenizer.encode("用四川话说这句话<|endofprompt|>")
    assert ids[-1] == text_tokenizer.token_to_id(END_OF_PROMPT)
    assert frontend.prepare_instruct("Speak slowly<|endofprompt|>").tolist() == text_tokenizer.encode(
        "Speak slowly<|endofprompt|>"
    )
    with pytest.raises(RequestError) as info:
        frontend.prepare_instruct(" ")
    assert info.value.code == "empty_text" and "instruct_text" in str(info.value)
    with pytest.raises(RequestError) as info:
        frontend.prepare_instruct("y" * 501)
    assert info.value.code == "text_too_long"


def test_prompt_text(frontend: TextFrontend, text_tokenizer: TextTokenizer) -> None:
    ids = frontend.prepare_prompt_text("希望你以后能够做的比我还好呦。我有3个")
    assert ids.tolist() == text_tokenizer.encode("希望你以后能够做的比我还好呦。我有三个")
    assert frontend.prepare_prompt_text("").size == 0  # cross-lingual: no transcript


def test_markup_is_one_segment_unchanged(frontend: TextFrontend, text_tokenizer: TextTokenizer) -> None:
    text = "You are a helpful assistant.<|endofprompt|>I have 3 cats. And 2 dogs."
    segments = frontend.prepare(text)
    assert [s.text for s in segments] == [text]


def test_normalize_off(text_tokenizer: TextTokenizer) -> None:
    fe = TextFrontend(text_tokenizer, normalize=False)
    assert [s.text for s in fe.prepare("I have 3 cats. 你好")] == ["I have 3 cats. 你好"]


def test_settings(text_tokenizer: TextTokenizer) -> None:
    with pytest.raises(ValueError, match="auto, zh, en, other"):
        TextFrontend(text_tokenizer, language="de")
    with pytest.raises(ValueError, match="max_text_chars"):
        TextFrontend(text_tokenizer, max_text_chars=0)
    fe = TextFrontend(text_tokenizer, language="en")
    assert fe.prepare("Bonjour 3 amis")[0].text == "Bonjour three amis."
    quick = TextFrontend(text_tokenizer, split=SplitSettings(first_segment_max_n=15))
    first = quick.prepare(LONG_ZH)[0]
    assert len(first.text) <= 15


def test_unpunctuated_text_is_capped(text_tokenizer: TextTokenizer) -> None:
    fe = TextFrontend(text_tokenizer, max_text_chars=5000)
    segments = fe.prepare("没有标点的一段很长的文字，" * 60)
    assert len(segments) > 1 and all(len(s.text) <= 200 for s in segments)
