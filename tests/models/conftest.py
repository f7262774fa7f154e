"""Fixtures for the model-runtime tests: a Qwen2-style tokenizer built here
the way upstream builds CosyVoice's (a byte-level BPE saved as a
Qwen2Tokenizer directory, loaded with transformers' AutoTokenizer, plus
QwenTokenizer's special tokens), saved as the bundle's tokenizer.json.

TensorRT backend tests (`pytest -m gpu`) run only where a GPU, a real
TensorRT and pycuda exist; the check never imports tensorrt on a machine
without a GPU (that can segfault) and does not take the type-stub package
(an importable but empty `tensorrt`) for TensorRT."""

from __future__ import annotations

import functools
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer, load_synthesizer

from tests.support.components import not_here

# What upstream's QwenTokenizer.__init__ adds (cosyvoice/tokenizer/tokenizer.py).
UPSTREAM_SPECIAL_TOKENS = {
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
    "additional_special_tokens": [
        "<|im_start|>",
        "<|im_end|>",
        "<|endofprompt|>",
        "[breath]",
        "<strong>",
        "</strong>",
        "[noise]",
        "[laughter]",
        "[cough]",
        "[clucking]",
        "[accent]",
        "[quick_breath]",
        "<laughter>",
        "</laughter>",
        "[hissing]",
        "[sigh]",
        "[vocalized-noise]",
        "[lipsmack]",
        "[mn]",
    ],
}

TRAINING_TEXT = [
    "Hello world, this is a small tokenizer for the CosyVoice tests.",
    "The quick brown fox jumps over the lazy dog; numbers 0123456789 and dates.",
    "You're sure it's fine? We'll see, they've said they'd come.",
    "你好，世界！今天天气很好，我们一起去公园散步吧。",
    "收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。",
    "CosyVoice 二 是一个语音合成模型, with streaming and zero-shot voice cloning.",
    "Привет, мир! Grüße aus München, ça va? こんにちは、カタカナ。",
    "In 1990 the price was $5.20, about twenty percent more than in nineteen eighty.",
]


@pytest.fixture(scope="module")
def engine(tiny_bundle: Path) -> Iterator[CosyVoiceSynthesizer]:
    """The tiny bundle's engine, one per test module (test_pipeline_parity
    overrides it with upstream's vocoder noise)."""
    eng = load_synthesizer(tiny_bundle)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CosyVoice-BlankEN-like tokenizer directory (vocab.json, merges.txt,
    tokenizer_config.json) trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = tmp_path_factory.mktemp("blank_en")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(TRAINING_TEXT * 20, trainer)
    tok.model.save(str(out))
    config: dict[str, Any] = {
        "tokenizer_class": "Qwen2Tokenizer",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 32768,
        "split_special_tokens": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="session")
def hf_tokenizer(hf_tokenizer_dir: Path) -> Any:
    """The tokenizer as upstream's QwenTokenizer holds it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_tokenizer_dir))
    tok.add_special_tokens(UPSTREAM_SPECIAL_TOKENS)
    return tok


@pytest.fixture(scope="session")
def tokenizer_json(hf_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundle's tokenizer.json: the HF fast tokenizer's backend, saved."""
    path = tmp_path_factory.mktemp("bundle") / "tokenizer.json"
    hf_tokenizer.backend_tokenizer.save(str(path))
    return path


@pytest.fixture(scope="session")
def text_tokenizer(tokenizer_json: Path) -> Any:
    from cosyedge_models.text.tokenizer import TextTokenizer

    return TextTokenizer.from_file(tokenizer_json)





@functools.cache
def trt_unavailable_reason() -> str | None:
    from cosyedge_models.backends.gpu_probe import probe_gpu, probe_tensorrt

    gpu = probe_gpu()
    if not gpu.available:
        return f"no GPU ({gpu.reason})"
    trt = probe_tensorrt()
    if not trt.available:
        return f"no TensorRT ({trt.reason})"
    if importlib.util.find_spec("pycuda") is None:
        return "pycuda is not installed (pip install pycuda==2025.1.2 on the GPU machine)"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A `-m gpu` test of the TensorRT backend where no TensorRT runs: not_here, before its fixtures."""
    if item.get_closest_marker("gpu") and "trt" in item.nodeid:
        reason = trt_unavailable_reason()
        if reason:
            not_here(f"TensorRT backend tests need a GPU with TensorRT: {reason}")
