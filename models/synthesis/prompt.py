"""Voice prompt features for zero-shot / cross-lingual / instruct2 synthesis.

`extract_prompt` replicates upstream `CosyVoiceFrontEnd.frontend_zero_shot`
(the prompt half) for CosyVoice 2: the speaker embedding is campplus on the
mean-normalised 80-bin Kaldi fbank of the 16 kHz audio, the prompt speech
tokens are the speech tokenizer on whisper's 128-bin log mel of the 16 kHz
audio (refused above 30 s, as upstream asserts), the prompt mel is matcha's
mel of the 24 kHz audio, and mel and tokens are cut to a 2:1 length
(`token_len = min(feat_len // 2, token_len)`). Both rates are resampled from
the given audio (upstream's current `load_wav` does the same; older upstream
resampled 16 kHz -> 24 kHz). The transcript is normalized and tokenized as
upstream's `text_normalize(prompt_text, split=False)` when a TextFrontend is
given.

`PromptFeatures.save` / `load` read and write the bundle's voice files
(`voices/<name>.npz`, BUNDLE.md "Voices").
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from cosyedge_models.errors import BundleError, RequestError, SynthesisError
from cosyedge_models.synthesis.features import (
    FLOW_SAMPLE_RATE,
    WHISPER_SAMPLE_RATE,
    campplus_features,
    prompt_mel,
    resample,
    to_mono,
    whisper_log_mel,
)
from cosyedge_models.text.frontend import TextFrontend
from cosyedge_models.text.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)

INVALID_PROMPT_AUDIO = "invalid_prompt_audio"
PROMPT_TOO_LONG = "prompt_too_long"
PROMPT_TOO_SHORT = "prompt_too_short"

MAX_PROMPT_SECONDS = 30.0  # upstream's speech tokenizer limit
MIN_PROMPT_SECONDS = 0.5
MIN_PROMPT_SAMPLE_RATE = 16000  # upstream's load_wav refuses lower rates
TOKEN_MEL_RATIO = 2  # CosyVoice 2: 25 Hz tokens, 50 Hz mel frames

# fbank [1, T, 80] float32 -> embedding [1, E]
CampplusRun = Callable[[np.ndarray], np.ndarray]
# log mel [1, 128, T] float32, lengths [1] int32 -> tokens [1, ~T / 4]
SpeechTokenizerRun = Callable[[np.ndarray, np.ndarray], np.ndarray]

_VOICE_KEYS = ("embedding", "prompt_text", "prompt_speech_token", "prompt_feat", "prompt_transcript")


@dataclass(frozen=True)
class PromptFeatures:
    """What the LLM and the flow need of a voice. An sft voice has only the
    embedding (the prompt arrays are empty)."""

    embedding: np.ndarray  # [E] float32, campplus
    prompt_text: np.ndarray  # [Tp] int64, transcript token ids
    prompt_speech_token: np.ndarray  # [Ts] int64
    prompt_feat: np.ndarray  # [TOKEN_MEL_RATIO * Ts, C] float32, 24 kHz mel
    transcript: str = ""

    def __post_init__(self) -> None:
        coerce = {
            "embedding": np.float32,
            "prompt_text": np.int64,
            "prompt_speech_token": np.int64,
            "prompt_feat": np.float32,
        }
        for name, dtype in coerce.items():
            object.__setattr__(self, name, np.ascontiguousarray(getattr(self, name), dtype=dtype))
        if self.embedding.ndim != 1 or self.embedding.size == 0:
            raise ValueError(f"embedding must have shape [E], got {self.embedding.shape}")
        if self.prompt_text.ndim != 1 or self.prompt_speech_token.ndim != 1:
            raise ValueError("prompt_text and prompt_speech_token must be 1-D")
        if self.prompt_feat.ndim != 2:
            raise ValueError(f"prompt_feat must have shape [frames, mel bins], got {self.prompt_feat.shape}")
        if self.prompt_feat.shape[0] != TOKEN_MEL_RATIO * self.prompt_speech_token.size:
            raise ValueError(
                f"prompt_feat has {self.prompt_feat.shape[0]} frames but {self.prompt_speech_token.size} "
                f"prompt tokens; expected {TOKEN_MEL_RATIO} frames per token"
            )

    @property
    def has_prompt_speech(self) -> bool:
        return self.prompt_speech_token.size > 0

    @classmethod
    def sft(cls, embedding: np.ndarray, mel_bins: int = 80) -> PromptFeatures:
        """A voice with only a speaker embedding (upstream's spk2info entries)."""
        return cls(
            embedding=np.asarray(embedding).reshape(-1),
            prompt_text=np.zeros(0, np.int64),
            prompt_speech_token=np.zeros(0, np.int64),
            prompt_feat=np.zeros((0, mel_bins), np.float32),
        )

    def save(self, path: str | Path) -> None:
        """Write the voice npz atomically (a reader never sees half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(
                    f,
                    embedding=self.embedding,
                    prompt_text=self.prompt_text,
                    prompt_speech_token=self.prompt_speech_token,
                    prompt_feat=self.prompt_feat,
                    prompt_transcript=np.array(self.transcript),
                )
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | Path) -> PromptFeatures:
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as data:
                missing = [k for k in _VOICE_KEYS if k not in data.files]
                if missing:
                    raise BundleError(
                        f"voice file {path} lacks {', '.join(missing)}; "
                        f"a voice npz holds {', '.join(_VOICE_KEYS)}"
                    )
                arrays = {k: data[k] for k in _VOICE_KEYS}
        except BundleError:
            raise
        except (OSError, ValueError) as exc:
            raise BundleError(f"cannot read voice file {path}: {exc}") from exc
        transcript = arrays.pop("prompt_transcript")
        if transcript.ndim != 0 or transcript.dtype.kind != "U":
            raise BundleError(f"voice file {path}: prompt_transcript must be a 0-d string array")
        try:
            return cls(**arrays, transcript=str(transcript))
        except ValueError as exc:
            raise BundleError(f"voice file {path} is inconsistent: {exc}") from exc


class _OrtInput(Protocol):
    name: str


class OrtSessionLike(Protocol):
    """The part of onnxruntime.InferenceSession used here."""

    def get_inputs(self) -> Sequence[_OrtInput]: ...

    def run(self, output_names: Any, input_feed: dict[str, np.ndarray]) -> list[Any]: ...


def campplus_runner(session: OrtSessionLike) -> CampplusRun:
    """campplus.onnx as a CampplusRun (first input, first output, as upstream)."""
    name = session.get_inputs()[0].name
    return lambda feat: np.asarray(session.run(None, {name: feat})[0])


def speech_tokenizer_runner(session: OrtSessionLike) -> SpeechTokenizerRun:
    """speech_tokenizer_v2.onnx as a SpeechTokenizerRun (inputs: mel, lengths)."""
    inputs = session.get_inputs()
    if len(inputs) < 2:
        raise BundleError("the speech tokenizer model must take two inputs (log mel, lengths)")
    mel_name, len_name = inputs[0].name, inputs[1].name
    return lambda mel, lengths: np.asarray(session.run(None, {mel_name: mel, len_name: lengths})[0])


def _checked_audio(pcm: np.ndarray, sample_rate: int, max_seconds: float, min_seconds: float) -> np.ndarray:
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int | np.integer):
        raise RequestError(
            INVALID_PROMPT_AUDIO, f"prompt sample rate must be a whole number of Hz, got {sample_rate!r}"
        )
    if sample_rate < MIN_PROMPT_SAMPLE_RATE:
        raise RequestError(
            INVALID_PROMPT_AUDIO,
            f"prompt audio must be sampled at {MIN_PROMPT_SAMPLE_RATE} Hz or more, got {sample_rate!r}",
        )
    try:
        x = to_mono(pcm)
    except ValueError as exc:
        raise RequestError(INVALID_PROMPT_AUDIO, f"prompt audio: {exc}") from exc
    if not np.isfinite(x).all():
        raise RequestError(INVALID_PROMPT_AUDIO, "prompt audio contains NaN or infinite samples")
    seconds = x.size / sample_rate
    if seconds > max_seconds:
        raise RequestError(
            PROMPT_TOO_LONG, f"prompt audio is {seconds:.1f} s long; the limit is {max_seconds:g} s"
        )
    if seconds < min_seconds:
        raise RequestError(
            PROMPT_TOO_SHORT, f"prompt audio is {seconds:.2f} s long; at least {min_seconds:g} s is needed"
        )
    return x


def extract_prompt(
    pcm: np.ndarray,
    sample_rate: int,
    transcript: str,
    campplus_run: CampplusRun,
    tokenizer_run: SpeechTokenizerRun,
    text_tokenizer: TextFrontend | TextTokenizer,
    *,
    max_seconds: float = MAX_PROMPT_SECONDS,
    min_seconds: float = MIN_PROMPT_SECONDS,
) -> PromptFeatures:
    """Prompt audio (float mono or [N, channels], any rate >= 16 kHz) and its
    transcript -> PromptFeatures. A TextFrontend normalizes the transcript
    first (upstream's behaviour); a bare TextTokenizer encodes it as given.
    An empty transcript (cross-lingual) gives empty prompt_text."""
    audio = _checked_audio(pcm, sample_rate, max_seconds, min_seconds)
    if isinstance(text_tokenizer, TextFrontend):
        prompt_text = text_tokenizer.prepare_prompt_text(transcript)
    else:
        prompt_text = np.asarray(text_tokenizer.encode(transcript) if transcript else [], dtype=np.int64)

    audio16k = resample(audio, int(sample_rate), WHISPER_SAMPLE_RATE)
    audio24k = resample(audio, int(sample_rate), FLOW_SAMPLE_RATE)
    feat = prompt_mel(audio24k)

    mel = whisper_log_mel(audio16k, n_mels=128)[None]
    try:
        tokens = np.asarray(tokenizer_run(mel, np.array([mel.shape[2]], dtype=np.int32))).reshape(-1)
        embedding = np.asarray(campplus_run(campplus_features(audio16k)[None])).reshape(-1)
    except (RequestError, SynthesisError):
        raise
    except Exception as exc:  # a backend failure is the engine's, not the request's
        raise SynthesisError(f"prompt feature extraction failed: {exc}") from exc
    if embedding.size == 0 or not np.isfinite(embedding).all():
        raise SynthesisError("campplus returned an empty or non-finite speaker embedding")
    if tokens.dtype.kind not in "iu":
        raise SynthesisError(f"the speech tokenizer returned {tokens.dtype} tokens; expected integers")

    token_len = min(feat.shape[0] // TOKEN_MEL_RATIO, tokens.size)
    if token_len == 0:
        raise RequestError(PROMPT_TOO_SHORT, "prompt audio is too short to give any speech token")
    logger.debug("prompt: %d tokens, %d mel frames, %d text ids", token_len, feat.shape[0], prompt_text.size)
    return PromptFeatures(
        embedding=embedding,
        prompt_text=prompt_text,
        prompt_speech_token=tokens[:token_len],
        prompt_feat=feat[: TOKEN_MEL_RATIO * token_len],
        transcript=transcript,
    )
