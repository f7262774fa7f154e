"""voices/<name>.npz from upstream's spk2info.pt: sft speakers (an
embedding only) and zero-shot speakers (embedding plus prompt text, speech
tokens and mel), in the layout models/bundle/BUNDLE.md describes."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
from cosyedge_build.export.tokenizer import decode
from cosyedge_build.reference.modules import require
from cosyedge_models.errors import CheckpointError

log = logging.getLogger(__name__)

SPK2INFO = "spk2info.pt"
VOICE_DIR = "voices"


def _array(value: Any, dtype: Any) -> np.ndarray:
    return np.asarray(value.detach().cpu().numpy() if hasattr(value, "detach") else value, dtype=dtype)


def _file_name(name: str, taken: set[str]) -> str:
    base = re.sub(r"[^\w.-]", "_", name).strip(".") or "voice"
    candidate, n = base, 1
    while candidate.lower() in taken:
        n += 1
        candidate = f"{base}_{n}"
    taken.add(candidate.lower())
    return f"{candidate}.npz"


def voice_arrays(info: dict[str, Any], mel_bins: int, tokenizer_path: Path) -> dict[str, np.ndarray] | None:
    embedding = info.get("embedding", info.get("flow_embedding"))
    if embedding is None:
        return None
    prompt_text = _array(info.get("prompt_text", np.zeros((0,))), np.int64).reshape(-1)
    speech = info.get("flow_prompt_speech_token", info.get("llm_prompt_speech_token", np.zeros((0,))))
    feat = info.get("prompt_speech_feat", np.zeros((0, mel_bins)))
    transcript = decode(tokenizer_path, prompt_text.tolist()) if prompt_text.size else ""
    return {
        "embedding": _array(embedding, np.float32).reshape(-1),
        "prompt_text": prompt_text,
        "prompt_speech_token": _array(speech, np.int64).reshape(-1),
        "prompt_feat": _array(feat, np.float32).reshape(-1, mel_bins),
        "prompt_transcript": np.array(transcript),
    }


def export_voices(model_dir: Path, out: Path, mel_bins: int, tokenizer_path: Path) -> dict[str, str]:
    """Returns voice name -> path relative to the bundle."""
    path = model_dir / SPK2INFO
    if not path.is_file():
        log.info("%s has no %s: the bundle has no built-in voices", model_dir, SPK2INFO)
        return {}
    torch = require("torch", "torch", "reading spk2info.pt")
    try:
        spk2info = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path} is not a PyTorch speaker table: {exc}") from exc
    if not isinstance(spk2info, dict):
        raise CheckpointError(f"{path} holds a {type(spk2info).__name__}; expected a dict of speakers")
    (out / VOICE_DIR).mkdir(exist_ok=True)
    voices: dict[str, str] = {}
    taken: set[str] = set()
    for name, info in spk2info.items():
        arrays = voice_arrays(info, mel_bins, tokenizer_path) if isinstance(info, dict) else None
        if arrays is None:
            log.warning("%s: speaker %r has no embedding; skipped", path, name)
            continue
        rel = f"{VOICE_DIR}/{_file_name(str(name), taken)}"
        save_npz: Any = np.savez  # numpy stubs take the first keyword for allow_pickle
        save_npz(out / rel, **arrays)
        voices[str(name)] = rel
    return voices
