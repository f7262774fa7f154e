"""The official PyTorch pipeline on the same checkpoint, for benchmarks and
parity tests: upstream's `CosyVoice2Model.tts` (LLM thread, streaming
token2wav with its hop, look-ahead, HiFT cache and cross-fade) over the
upstream modules loaded by `cosyedge_build.reference.modules`.

The reference package's `CosyVoice2Model` leaves out the LLM (it is a
token-to-wav build); the upstream class at the pinned commit sets
`self.llm = llm`, which is all we add."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from cosyedge_build.reference.modules import ReferenceModels, install_stand_ins, load_reference, require
from cosyedge_models.bundle.loader import Bundle
from cosyedge_models.synthesis.prompt import PromptFeatures


def official_model(refs: ReferenceModels) -> Any:
    """upstream cosyvoice.cli.model.CosyVoice2Model with the LLM attached."""
    require("torch", "torch", "the reference pipeline")
    install_stand_ins()
    from cosyvoice.cli.model import CosyVoice2Model

    model = CosyVoice2Model(refs.llm, refs.flow, refs.hift, False)
    # Upstream's load() moves the modules to the device it picked (the GPU when
    # torch sees one); we load the modules ourselves, so move them the same way.
    for module in (refs.llm, refs.flow, refs.hift):
        module.to(model.device)
    model.llm = refs.llm
    return model


def model_inputs(voice: PromptFeatures, text_ids: Sequence[int], mode: str = "sft",
                 prompt_text_ids: Sequence[int] = ()) -> dict[str, Any]:
    """The keyword arguments upstream's frontend builds for `tts()`."""
    import torch

    emb = torch.from_numpy(np.asarray(voice.embedding, dtype=np.float32))[None]
    inputs: dict[str, Any] = {"text": torch.tensor([list(text_ids)], dtype=torch.int32),
                              "flow_embedding": emb, "llm_embedding": emb}
    if mode in ("zero_shot", "cross_lingual", "instruct") and voice.has_prompt_speech:
        tokens = torch.from_numpy(voice.prompt_speech_token.astype(np.int32))[None]
        inputs["flow_prompt_speech_token"] = tokens
        inputs["prompt_speech_feat"] = torch.from_numpy(voice.prompt_feat.astype(np.float32))[None]
        if mode == "zero_shot":
            inputs["llm_prompt_speech_token"] = tokens
    if mode in ("zero_shot", "instruct"):
        ids = list(prompt_text_ids) if mode == "instruct" else voice.prompt_text.tolist()
        inputs["prompt_text"] = torch.tensor([ids], dtype=torch.int32)
    return inputs


def synthesize(model: Any, inputs: dict[str, Any], stream: bool) -> Iterator[np.ndarray]:
    for out in model.tts(**inputs, stream=stream):
        yield out["tts_speech"].numpy().reshape(-1)


def patch_sampling(llm: Any, sample: Callable[[np.ndarray, list[int]], int]) -> Callable[[], None]:
    """Replace upstream's ras_sampling on `llm` by `sample(logp, decoded)`
    (our seeded sampler), so both pipelines draw the same tokens; returns
    the undo function."""
    import torch

    original = llm.sampling

    def sampling(weighted_scores: Any, decoded_tokens: list[int], _top_k: int) -> Any:
        return torch.tensor([sample(weighted_scores.float().cpu().numpy(), decoded_tokens)])

    llm.sampling = sampling

    def undo() -> None:
        llm.sampling = original

    return undo


def run_reference(bundle: Bundle, tokenizer: Any, text: str, repeats: int = 3,
                  model_dir: Path | None = None, voice: str | None = None) -> dict[str, Any]:
    """RTF (offline) and time to first audio (streaming) of the official
    pipeline on the bundle's source checkpoint, with upstream's own sampler;
    with `voice`, that saved voice in zero_shot mode (else the default voice, sft)."""
    import torch

    src = model_dir or Path(bundle.manifest.get("source", {}).get("model_dir", ""))
    refs = load_reference(src)
    model = official_model(refs)
    voice_name = voice or bundle.default_voice or next(iter(bundle.voices))
    features = PromptFeatures.load(bundle.voices[voice_name])
    inputs = model_inputs(features, tokenizer.encode(text), "zero_shot" if voice else "sft")
    threads = torch.get_num_threads()
    rtfs: list[float] = []
    firsts: list[float] = []
    audio = 0.0
    list(synthesize(model, inputs, stream=True))  # warm-up
    for _ in range(repeats):
        t0 = time.perf_counter()
        samples = sum(x.size for x in synthesize(model, inputs, stream=False))
        total = time.perf_counter() - t0
        audio = samples / bundle.sample_rate
        rtfs.append(total / audio)
        t0 = time.perf_counter()
        first: float | None = None
        for _chunk in synthesize(model, inputs, stream=True):  # consumed whole: its LLM thread must end
            first = first if first is not None else (time.perf_counter() - t0) * 1e3
        firsts.append(first if first is not None else float("nan"))
    return {"rtf": round(statistics.median(rtfs), 4), "first_audio_ms": round(statistics.median(firsts), 1),
            "audio_s": round(audio, 2), "torch": torch.__version__, "torch_threads": threads,
            "device": str(model.device), "voice": voice_name, "mode": "zero_shot" if voice else "sft",
            "model_dir": str(src)}
