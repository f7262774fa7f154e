"""The bundle's tokenizer.json, loaded with `tokenizers` (what the runtime
uses), against upstream's QwenTokenizer on the checkpoint."""

from __future__ import annotations

import json

import pytest
from cosyedge_build.reference.modules import load_qwen_tokenizer
from tokenizers import Tokenizer

from tests.edge_build.conftest import Checkpoint

TEXTS = [
    "Hello, world! How are you today?",
    "今天天气很好，我们一起去公园散步吧。",
    "こんにちは、世界！東京駅で午後三時に会いましょう。",
    "안녕하세요, 세계! 서울역에서 만나요.",
    "Über die Brücke, schöne Grüße aus Köln; où est la gare ? Ça va !",
    "Numbers 0 1 23 456 7.89 -10 1,000,000 and 3:30pm on 2026-11-29.",
    "You are a helpful assistant.<|endofprompt|>Speak slowly, please.",
    "<|im_start|>mixed 中文 English 日本語 한국어 [breath] text<|im_end|> [laughter] <strong>loud</strong>",
    "unseen words: Zyxwvut qwertyuiop ÆØÅ ñ ü ß 🎉 emoji and tabs\tand\nnewlines",
    "",
]


@pytest.fixture(scope="module")
def upstream(checkpoint: Checkpoint):  # type: ignore[no-untyped-def]
    return load_qwen_tokenizer(checkpoint.model_dir)


def test_tokenizer_json_matches_qwen_tokenizer(checkpoint: Checkpoint, upstream) -> None:  # type: ignore[no-untyped-def]
    ours = Tokenizer.from_file(str(checkpoint.bundle / "tokenizer.json"))
    for text in TEXTS:
        expected = upstream.encode(text)
        assert ours.encode(text).ids == expected, text
        assert ours.decode(expected, skip_special_tokens=True) == upstream.decode(expected)


def test_special_tokens_are_single_ids(checkpoint: Checkpoint, upstream) -> None:  # type: ignore[no-untyped-def]
    ours = Tokenizer.from_file(str(checkpoint.bundle / "tokenizer.json"))
    manifest = json.loads((checkpoint.bundle / "manifest.json").read_text())
    special = manifest["tokenizer"]["special_tokens"]
    assert {
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|endofprompt|>",
        "[breath]",
        "[laughter]",
    } <= set(special)
    for token, token_id in special.items():
        assert ours.encode(token).ids == [token_id] == upstream.encode(token)
    # the text vocabulary of the LLM covers every id the tokenizer can produce
    assert ours.get_vocab_size(with_added_tokens=True) <= manifest["llm"]["text_vocab_size"]
