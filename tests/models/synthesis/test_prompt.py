"""extract_prompt on real onnxruntime sessions of small random models with
campplus's and the speech tokenizer's I/O (exported here with torch.onnx),
compared with the same pipeline assembled from the reference feature code;
the voice npz format; the errors for bad prompt audio."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cosyedge_models.errors import BundleError, RequestError, SynthesisError
from cosyedge_models.synthesis.features import load_audio, resample
from cosyedge_models.synthesis.prompt import (
    PromptFeatures,
    campplus_runner,
    extract_prompt,
    speech_tokenizer_runner,
)
from cosyedge_models.text.frontend import TextFrontend
from cosyedge_models.text.tokenizer import TextTokenizer

from tests.models.synthesis.test_features import _knf_fbank, _speechlike, _whisper_reference
from tests.support.components import require_module

torch = require_module("torch")
ort = require_module("onnxruntime")


class _Campplus(torch.nn.Module):  # fbank [1, T, 80] -> embedding [1, 192]
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(80, 192)

    def forward(self, feat: Any) -> Any:
        return torch.tanh(self.proj(feat)).mean(dim=1)


class _SpeechTokenizer(torch.nn.Module):  # mel [1, 128, T] float32, len [1] int32 -> tokens [1, T / 4]
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(128, 64, kernel_size=4, stride=4)

    def forward(self, feats: Any, feats_length: Any) -> Any:
        valid = torch.arange(feats.shape[2])[None, None, :] < feats_length.long()[:, None, None]
        return self.conv(feats * valid.float()).argmax(dim=1)


@pytest.fixture(scope="module")
def sessions(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    out = tmp_path_factory.mktemp("onnx")
    torch.manual_seed(0)
    frames = torch.export.Dim("T", min=8, max=6000)
    torch.onnx.export(
        _Campplus().eval(),
        (torch.randn(1, 50, 80),),
        str(out / "campplus.onnx"),
        input_names=["input"],
        output_names=["output"],
        dynamic_shapes=({1: frames},),
        dynamo=True,
        external_data=False,
    )
    torch.onnx.export(
        _SpeechTokenizer().eval(),
        (torch.randn(1, 128, 100), torch.tensor([100], dtype=torch.int32)),
        str(out / "speech_tokenizer_v2.onnx"),
        input_names=["feats", "feats_length"],
        output_names=["indices"],
        dynamic_shapes=({2: frames}, None),
        dynamo=True,
        external_data=False,
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    campplus = ort.InferenceSession(str(out / "campplus.onnx"), options, providers=["CPUExecutionProvider"])
    tokenizer = ort.InferenceSession(
        str(out / "speech_tokenizer_v2.onnx"), options, providers=["CPUExecutionProvider"]
    )
    return campplus, tokenizer


@pytest.fixture()
def frontend(text_tokenizer: TextTokenizer) -> TextFrontend:
    return TextFrontend(text_tokenizer)


def _extract(
    sessions: tuple[Any, Any], frontend: Any, pcm: np.ndarray, rate: int, text: str = ""
) -> PromptFeatures:
    campplus, tokenizer = sessions
    return extract_prompt(
        pcm, rate, text, campplus_runner(campplus), speech_tokenizer_runner(tokenizer), frontend
    )


@pytest.mark.parametrize("rate", [16000, 24000, 44100])
def test_matches_reference_pipeline(
    sessions: tuple[Any, Any], frontend: TextFrontend, text_tokenizer: TextTokenizer, rate: int
) -> None:
    matcha_audio = require_module("matcha.utils.audio")
    pcm = _speechlike(3.3, rate, seed=rate)
    prompt = _extract(sessions, frontend, pcm, rate, "希望你以后能够做的比我还好呦，我有3个。")

    # the same steps as upstream frontend_zero_shot, with the reference feature code
    campplus, tokenizer = sessions
    pcm16, pcm24 = resample(pcm, rate, 16000), resample(pcm, rate, 24000)
    fbank = _knf_fbank(pcm16)
    embedding = campplus.run(
        None, {"input": (fbank - fbank.mean(0, keepdims=True))[None].astype(np.float32)}
    )[0]
    mel = _whisper_reference(pcm16, 128)[None].astype(np.float32)
    tokens = tokenizer.run(None, {"feats": mel, "feats_length": np.array([mel.shape[2]], np.int32)})[0]
    feat = matcha_audio.mel_spectrogram(
        torch.from_numpy(pcm24)[None], 1920, 80, 24000, 480, 1920, 0, 8000, center=False
    )[0].T.numpy()
    token_len = min(feat.shape[0] // 2, tokens.shape[1])

    assert prompt.embedding.shape == (192,) and prompt.embedding.dtype == np.float32
    np.testing.assert_allclose(prompt.embedding, embedding[0], atol=1e-4)
    # argmax tokens: allow a rare flip where two logits nearly tie
    assert prompt.prompt_speech_token.shape == (token_len,) and prompt.prompt_speech_token.dtype == np.int64
    assert np.mean(prompt.prompt_speech_token == tokens[0, :token_len]) > 0.97
    assert prompt.prompt_feat.shape == (2 * token_len, 80)
    np.testing.assert_allclose(prompt.prompt_feat, feat[: 2 * token_len], atol=1e-4)
    assert prompt.prompt_text.tolist() == text_tokenizer.encode("希望你以后能够做的比我还好呦，我有三个。")
    assert prompt.transcript == "希望你以后能够做的比我还好呦，我有3个。"


def test_token_and_mel_alignment(sessions: tuple[Any, Any], frontend: TextFrontend) -> None:
    # 16 kHz -> whisper frames N // 160 -> tokens (N // 160) // 4; mel frames N24 // 480
    for seconds in (0.5, 1.01, 2.37, 29.9):
        pcm = _speechlike(seconds, 16000, seed=1)
        prompt = _extract(sessions, frontend, pcm, 16000)
        n_tokens = (pcm.size // 160) // 4
        n_mel = (pcm.size * 3 // 2) // 480
        assert prompt.prompt_speech_token.size == min(n_mel // 2, n_tokens)
        assert prompt.prompt_feat.shape[0] == 2 * prompt.prompt_speech_token.size
        assert prompt.prompt_text.size == 0  # no transcript: cross-lingual


def test_stereo_and_plain_tokenizer(
    sessions: tuple[Any, Any], text_tokenizer: TextTokenizer, frontend: TextFrontend
) -> None:
    mono = _speechlike(1.5, 22050, seed=4)
    stereo = np.stack([mono, mono], axis=1)
    a = _extract(sessions, frontend, stereo, 22050, "I have 3 cats.")
    b = _extract(sessions, text_tokenizer, mono, 22050, "I have 3 cats.")
    np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-6)
    assert a.prompt_text.tolist() == text_tokenizer.encode("I have three cats.")
    assert b.prompt_text.tolist() == text_tokenizer.encode("I have 3 cats.")  # verbatim


@pytest.mark.parametrize(
    ("pcm", "rate", "code", "message"),
    [
        (np.zeros(16000 * 31, np.float32), 16000, "prompt_too_long", "31.0 s long; the limit is 30 s"),
        (np.zeros(4000, np.float32), 16000, "prompt_too_short", "at least 0.5 s"),
        (np.zeros(16000, np.float32), 8000, "invalid_prompt_audio", "16000 Hz or more"),
        (np.zeros(16000, np.float32), 16000.0, "invalid_prompt_audio", "whole number of Hz"),
        (np.full(16000, np.nan, np.float32), 16000, "invalid_prompt_audio", "NaN"),
        (np.zeros((2, 3, 16000), np.float32), 16000, "invalid_prompt_audio", "shape"),
    ],
)
def test_bad_prompt_audio(
    sessions: tuple[Any, Any], frontend: TextFrontend, pcm: np.ndarray, rate: int, code: str, message: str
) -> None:
    with pytest.raises(RequestError, match=message) as info:
        _extract(sessions, frontend, pcm, rate)
    assert info.value.code == code


def test_backend_failures_are_engine_errors(frontend: TextFrontend) -> None:
    pcm = _speechlike(1.0, 16000)

    def broken(*_: Any) -> np.ndarray:
        raise RuntimeError("CUDA error")

    with pytest.raises(SynthesisError, match="CUDA error"):
        extract_prompt(pcm, 16000, "", broken, broken, frontend)
    with pytest.raises(SynthesisError, match="non-finite"):
        extract_prompt(
            pcm,
            16000,
            "",
            lambda f: np.full((1, 192), np.nan),
            lambda m, n: np.zeros((1, 5), np.int64),
            frontend,
        )
    with pytest.raises(RequestError) as info:
        extract_prompt(
            pcm, 16000, "", lambda f: np.ones((1, 192)), lambda m, n: np.zeros((1, 0), np.int64), frontend
        )
    assert info.value.code == "prompt_too_short"


def test_voice_npz_roundtrip(sessions: tuple[Any, Any], frontend: TextFrontend, tmp_path: Path) -> None:
    prompt = _extract(sessions, frontend, _speechlike(2.0, 24000), 24000, "Hello there.")
    path = tmp_path / "voices" / "default.npz"
    prompt.save(path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["default.npz"]  # no temp file left
    with np.load(path, allow_pickle=False) as data:  # the BUNDLE.md layout
        assert sorted(data.files) == sorted(
            ["embedding", "prompt_text", "prompt_speech_token", "prompt_feat", "prompt_transcript"]
        )
        assert data["prompt_transcript"].shape == () and data["prompt_text"].dtype == np.int64
    loaded = PromptFeatures.load(path)
    for name in ("embedding", "prompt_text", "prompt_speech_token", "prompt_feat"):
        np.testing.assert_array_equal(getattr(loaded, name), getattr(prompt, name))
    assert loaded.transcript == "Hello there." and loaded.has_prompt_speech


def test_sft_voice(tmp_path: Path) -> None:
    voice = PromptFeatures.sft(np.ones((1, 192)))
    assert voice.embedding.shape == (192,) and not voice.has_prompt_speech
    assert voice.prompt_feat.shape == (0, 80)
    voice.save(tmp_path / "spk.npz")
    loaded = PromptFeatures.load(tmp_path / "spk.npz")
    assert loaded.prompt_speech_token.size == 0 and loaded.transcript == ""


def test_bad_voice_files(tmp_path: Path) -> None:
    missing = tmp_path / "missing.npz"
    np.savez(missing, embedding=np.ones(192, np.float32))
    with pytest.raises(BundleError, match="lacks prompt_text"):
        PromptFeatures.load(missing)
    inconsistent = tmp_path / "inconsistent.npz"
    np.savez(
        inconsistent,
        embedding=np.ones(192, np.float32),
        prompt_text=np.zeros(0, np.int64),
        prompt_speech_token=np.zeros(10, np.int64),
        prompt_feat=np.zeros((19, 80), np.float32),
        prompt_transcript=np.array(""),
    )
    with pytest.raises(BundleError, match="19 frames but 10 prompt tokens"):
        PromptFeatures.load(inconsistent)
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"nope")
    with pytest.raises(BundleError, match="cannot read voice file"):
        PromptFeatures.load(garbage)
    with pytest.raises(BundleError, match="cannot read"):
        PromptFeatures.load(tmp_path / "absent.npz")
    pickled = tmp_path / "pickled.npz"
    np.savez(
        pickled,
        embedding=np.ones(192, np.float32),
        prompt_text=np.zeros(0, np.int64),
        prompt_speech_token=np.zeros(0, np.int64),
        prompt_feat=np.zeros((0, 80), np.float32),
        prompt_transcript=np.array({"x": 1}, dtype=object),
    )
    with pytest.raises(BundleError):
        PromptFeatures.load(pickled)


def test_prompt_from_file(sessions: tuple[Any, Any], frontend: TextFrontend, tmp_path: Path) -> None:
    soundfile = require_module("soundfile")
    pcm = _speechlike(1.2, 48000, seed=11)
    soundfile.write(tmp_path / "p.flac", pcm, 48000)
    audio, rate = load_audio(tmp_path / "p.flac")
    prompt = _extract(sessions, frontend, audio, rate, "text")
    assert prompt.prompt_speech_token.size > 0


def test_runtime_modules_import_light() -> None:
    """The frontend and features load with numpy and tokenizers only (a
    Jetson has no torch, librosa, transformers or regex)."""
    import subprocess
    import sys

    code = (
        "import sys, cosyedge_models.synthesis.prompt, cosyedge_models.synthesis.features;"
        "import cosyedge_models.text.frontend;"
        "heavy = {'torch', 'transformers', 'librosa', 'scipy', 'regex', 'inflect', 'soxr', 'soundfile',"
        " 'onnxruntime', 'kaldi_native_fbank', 'matcha', 'cosyvoice'};"
        "print(sorted(heavy & set(sys.modules)))"
    )
    root = Path(__file__).resolve().parents[3]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]", result.stdout
