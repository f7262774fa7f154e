"""What each mode conditions the LLM and the flow on (upstream
`CosyVoiceFrontEnd.frontend_*` for CosyVoice 2):

| mode | LLM prompt text | LLM prompt speech | flow prompt (tokens, mel) | speaker embedding |
|---|---|---|---|---|
| sft | - | - | - | voice |
| zero_shot | transcript | prompt tokens | prompt | prompt |
| cross_lingual | - | - | prompt | prompt |
| instruct | instruct text + `<\\|endofprompt\\|>` | - | prompt (if the voice has one) | voice |

The voice is a named voice of the bundle or a reference recording sent with
the request (its features are extracted with the bundle's campplus and
speech tokenizer)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
from cosyedge_models.backends.base import Session
from cosyedge_models.bundle.loader import Bundle
from cosyedge_models.errors import RequestError
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.flow import FlowPrompt
from cosyedge_models.synthesis.modes import PROMPT_MODES
from cosyedge_models.synthesis.prompt import PromptFeatures, extract_prompt
from cosyedge_models.text.frontend import TextFrontend
from cosyedge_models.text.tokenizer import TextTokenizer


@dataclass(frozen=True)
class Conditioning:
    prompt_text: list[int]
    prompt_speech: list[int]
    flow: FlowPrompt
    voice: str | None = None  # the saved voice it came from (None: a prompt sent with the request)


class ConditioningBuilder:
    def __init__(self, bundle: Bundle, tokenizer: TextTokenizer, frontend: TextFrontend) -> None:
        self.bundle = bundle
        self.tokenizer = tokenizer
        self.frontend = frontend
        self._voices: dict[str, PromptFeatures] = {}
        self._lock = threading.Lock()
        self._campplus: Session | None = None
        self._speech_tokenizer: Session | None = None

    def close(self) -> None:
        for s in (self._campplus, self._speech_tokenizer):
            if s is not None:
                s.close()
        self._campplus = self._speech_tokenizer = None

    def voice_name(self, request: SynthesisRequest) -> str:
        name = request.voice or self.bundle.default_voice
        if name is None:
            raise RequestError("unknown_voice", "no voice given and the bundle has no default voice; "
                                                f"voices: {', '.join(sorted(self.bundle.voices)) or 'none'}")
        return name

    def check(self, request: SynthesisRequest) -> None:
        if request.mode == "instruct" and not (request.instruct_text or "").strip():
            raise RequestError("missing_instruct_text", "mode 'instruct' needs a non-empty instruct_text")
        if request.prompt is not None:
            if request.mode == "zero_shot" and not request.prompt.text.strip():
                raise RequestError("missing_prompt_text", "zero_shot with a prompt recording needs its transcript")
            return
        name = self.voice_name(request)
        if name not in self.bundle.voices:
            raise RequestError("unknown_voice", f"unknown voice {name!r}; voices: "
                                                f"{', '.join(sorted(self.bundle.voices)) or 'none'}")
        if request.mode in PROMPT_MODES:
            voice = self._voice(name)
            if voice.prompt_speech_token.size == 0:
                raise RequestError("voice_unsuitable", f"voice {name!r} has no reference recording, so it serves "
                                                       f"sft and instruct only, not {request.mode}")
            if request.mode == "zero_shot" and voice.prompt_text.size == 0:
                raise RequestError("voice_unsuitable", f"voice {name!r} has no transcript, so it cannot serve "
                                                       "zero_shot; use cross_lingual")

    def build(self, request: SynthesisRequest) -> Conditioning:
        saved = None if request.prompt is not None else self.voice_name(request)
        voice = self.prompt_features(request) if saved is None else self._voice(saved)
        empty_feat = np.zeros((0, self.bundle.mel_bins), dtype=np.float32)
        empty_tokens = np.zeros(0, dtype=np.int64)
        full_flow = FlowPrompt(voice.prompt_speech_token.astype(np.int64), voice.prompt_feat.astype(np.float32),
                               voice.embedding.astype(np.float32))
        if request.mode == "sft":
            return Conditioning([], [], FlowPrompt(empty_tokens, empty_feat, full_flow.embedding))
        if request.mode == "zero_shot":
            return Conditioning(voice.prompt_text.tolist(), voice.prompt_speech_token.tolist(), full_flow, saved)
        if request.mode == "cross_lingual":
            return Conditioning([], [], full_flow, saved)
        return Conditioning(self.frontend.prepare_instruct(request.instruct_text or "").tolist(), [], full_flow,
                            saved)

    def _voice(self, name: str) -> PromptFeatures:
        with self._lock:
            if name not in self._voices:
                self._voices[name] = PromptFeatures.load(self.bundle.voices[name])
            return self._voices[name]

    def _sessions(self) -> tuple[Session, Session]:
        with self._lock:
            if self._campplus is None or self._speech_tokenizer is None:
                # Upstream runs both on ONNX Runtime as shipped; so do we, on the CPU.
                from cosyedge_models.backends.ort import OrtBackend

                cpu = OrtBackend(providers=("CPUExecutionProvider",))
                self._campplus = cpu.load("campplus", self.bundle.carried("campplus"), threads=1)
                self._speech_tokenizer = cpu.load("speech_tokenizer", self.bundle.carried("speech_tokenizer"))
            return self._campplus, self._speech_tokenizer

    def prompt_features(self, request: SynthesisRequest) -> PromptFeatures:
        """Features of the reference recording the request carries."""
        assert request.prompt is not None
        campplus, speech_tokenizer = self._sessions()

        def run_campplus(feat: np.ndarray) -> np.ndarray:
            return next(iter(campplus.run({campplus.input_names[0]: feat}).values()))

        def run_tokenizer(feat: np.ndarray, length: np.ndarray) -> np.ndarray:
            names = speech_tokenizer.input_names
            return next(iter(speech_tokenizer.run({names[0]: feat, names[1]: length}).values()))

        transcript = request.prompt.text if request.mode != "cross_lingual" else ""
        return extract_prompt(request.prompt.pcm, request.prompt.sample_rate, transcript,
                              run_campplus, run_tokenizer, self.frontend)
