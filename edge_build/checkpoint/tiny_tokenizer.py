"""A small Qwen2-style byte-level BPE for the tiny checkpoint, trained here
on a built-in multilingual text, written as the files a Qwen2 model
directory carries (vocab.json, merges.txt, tokenizer_config.json,
tokenizer.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cosyedge_build.reference.modules import require

# Qwen2's pre-tokenizer split (transformers' PRETOKENIZE_REGEX for Qwen2)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CORPUS = """\
The quick brown fox jumps over the lazy dog. A speech daemon listens, thinks and speaks.
Hello, world! How are you today? I'm fine, thanks; it's a beautiful morning, isn't it?
Please turn on the kitchen lights and set the thermostat to 21.5 degrees at 7:30 pm.
The robot said: "Battery at 87%, next charge in 3 hours and 45 minutes."
Call me at +1 (555) 010-2024 or write to hello@example.com before 2026-11-29.
In 1969, humans walked on the Moon; in 2030, maybe on Mars. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.
We'll meet you're they've I'd he'll she's - short forms that English speakers love.
今天天气很好，我们一起去公园散步吧。你好，世界！请问现在几点了？
语音合成技术可以把文字转换成自然流畅的声音，机器人和智能音箱都在使用它。
我的电话号码是一三八零零一三八零零零，价格是九十九点五元。
北京、上海、广州和深圳是中国最大的城市之一。
こんにちは、世界！今日はとても良い天気ですね。音声合成はテキストを音声に変換します。
東京駅で午後三時に会いましょう。ありがとうございます、よろしくお願いします。
안녕하세요, 세계! 오늘 날씨가 정말 좋네요. 음성 합성은 텍스트를 소리로 바꿉니다.
서울역에서 오후 세 시에 만나요. 감사합니다, 잘 부탁드립니다.
Guten Morgen! Wie geht es Ihnen? Die Sprachsynthese wandelt Text in natürliche Sprache um.
Über die Brücke gehen wir zur Straße; schöne Grüße aus München, Köln und Düsseldorf.
Bonjour tout le monde ! Comment ça va ? La synthèse vocale transforme le texte en parole.
Où est la gare ? C'est à côté du café, près de l'hôtel ; à bientôt, merci beaucoup !
Punctuation: , . ; : ! ? ... -- ( ) [ ] { } < > " ' / \\ | @ # $ % ^ & * _ + = ~ `
Mixed: Hello 你好 こんにちは 안녕 Hallo Bonjour 123 4.56 7,890 — ok? 好的！はい。네.
"""


def train_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE with Qwen2's normalizer, pre-tokenizer and decoder;
    Qwen's special tokens come after the learned vocabulary, as in Qwen2."""
    tk = require("tokenizers", "tokenizers", "training the tiny checkpoint's tokenizer")
    tokenizer = tk.Tokenizer(tk.models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = tk.normalizers.NFC()
    tokenizer.pre_tokenizer = tk.pre_tokenizers.Sequence(
        [
            tk.pre_tokenizers.Split(tk.Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            tk.pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = tk.decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.post_processor = tk.processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
    )
    lines = CORPUS.splitlines()
    tokenizer.train_from_iterator(lines * 3, trainer=trainer)
    tokenizer.add_special_tokens([tk.AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL])
    return tokenizer


def write_qwen_tokenizer_files(tokenizer: Any, out: Path) -> int:
    """Write vocab.json, merges.txt, tokenizer_config.json (Qwen2Tokenizer)
    and tokenizer.json into `out`; return the number of tokens."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.model.save(str(out))  # vocab.json, merges.txt
    tokenizer.save(str(out / "tokenizer.json"))
    added = {
        str(tokenizer.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in QWEN_SPECIAL
    }
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return int(tokenizer.get_vocab_size(with_added_tokens=True))
