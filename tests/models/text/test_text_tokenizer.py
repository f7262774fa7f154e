"""TextTokenizer (tokenizers only) against the HF tokenizer upstream's
QwenTokenizer wraps, on mixed-language text with CosyVoice's special tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cosyedge_models.errors import BundleError
from cosyedge_models.text.tokenizer import COSYVOICE_SPECIAL_TOKENS, END_OF_PROMPT, TextTokenizer

from tests.models.conftest import UPSTREAM_SPECIAL_TOKENS

TEXTS = [
    "Hello world, this is a test.",
    "你好，世界！今天天气很好。",
    "收到好友从远方寄来的生日礼物[breath]，那份意外的惊喜<strong>与深深的祝福</strong>让我心中充满了甜蜜的快乐。",
    "用四川话说这句话<|endofprompt|>在他讲述那个荒诞故事的过程中，他突然[laughter]停下来。",
    "CosyVoice 2 mixes 中文 and English: it's 3.5 times faster [noise]!",
    "Grüße aus München — ça va? Привет! こんにちは。한국어도 돼요.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew lines\r\nand emoji 🎉 and ｆｕｌｌ-width",
    "[breath][laughter]<laughter>laughing</laughter>[cough][clucking][accent][quick_breath]",
    "[hissing] [sigh] [vocalized-noise] [lipsmack] [mn] <|im_start|>x<|im_end|><|endoftext|>",
    "not a token: [breath ] < strong> [Laughter]",
    "",
]


def _upstream_encode(hf: Any, text: str) -> list[int]:
    # QwenTokenizer.encode: self.tokenizer([text], return_tensors="pt")["input_ids"][0].tolist()
    return list(hf([text])["input_ids"][0])


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_upstream(text_tokenizer: TextTokenizer, hf_tokenizer: Any, text: str) -> None:
    assert text_tokenizer.encode(text) == _upstream_encode(hf_tokenizer, text)


def test_special_tokens_are_single_ids(text_tokenizer: TextTokenizer, hf_tokenizer: Any) -> None:
    for token in COSYVOICE_SPECIAL_TOKENS:
        ids = text_tokenizer.encode(token)
        assert ids == [hf_tokenizer.convert_tokens_to_ids(token)], token
    assert set(UPSTREAM_SPECIAL_TOKENS["additional_special_tokens"]) <= set(COSYVOICE_SPECIAL_TOKENS)
    eop = text_tokenizer.token_to_id(END_OF_PROMPT)
    assert eop is not None and text_tokenizer.encode("说<|endofprompt|>")[-1] == eop


def test_batch_and_vocab(text_tokenizer: TextTokenizer, hf_tokenizer: Any) -> None:
    assert text_tokenizer.encode_batch(TEXTS) == [_upstream_encode(hf_tokenizer, t) for t in TEXTS]
    assert text_tokenizer.vocab_size == len(hf_tokenizer)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_upstream(text_tokenizer: TextTokenizer, hf_tokenizer: Any, text: str) -> None:
    ids = _upstream_encode(hf_tokenizer, text)
    # QwenTokenizer.decode: batch_decode([tokens], skip_special_tokens=True)[0]
    expected = hf_tokenizer.batch_decode([ids], skip_special_tokens=True)[0]
    assert text_tokenizer.decode(ids) == expected
    assert text_tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)


def test_missing_special_tokens_refused(hf_tokenizer_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    bare = AutoTokenizer.from_pretrained(str(hf_tokenizer_dir))  # without QwenTokenizer's additions
    path = tmp_path / "tokenizer.json"
    bare.backend_tokenizer.save(str(path))
    with pytest.raises(BundleError, match="special tokens.*endofprompt"):
        TextTokenizer.from_file(path)
    lenient = TextTokenizer.from_file(path, require_special_tokens=False)
    assert END_OF_PROMPT in lenient.missing_special_tokens
    assert len(lenient.encode(END_OF_PROMPT)) > 1  # what would silently go wrong


def test_bad_files(tmp_path: Path, tokenizer_json: Path) -> None:
    with pytest.raises(BundleError, match="not found"):
        TextTokenizer.from_file(tmp_path / "nope.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(BundleError, match="cannot load tokenizer"):
        TextTokenizer.from_file(bad)
    # a directory means its tokenizer.json
    assert TextTokenizer.from_file(tokenizer_json.parent).encode("hi") == TextTokenizer.from_file(
        tokenizer_json
    ).encode("hi")
    assert json.loads(tokenizer_json.read_text())["model"]["type"] == "BPE"
