"""The tensors between the bridge and the Triton model `cosyvoice2`: what
the bridge sends (one request = one row of a batch), what each streamed
response holds, and how the model reports errors. numpy only: the Triton
model imports it inside the server's Python, the bridge in its own.

Inputs (the leading 1 is the batch dimension; max_batch_size > 0):
    TEXT               BYTES [1, 1]  UTF-8 text
    PARAMS             BYTES [1, 1]  JSON: mode, voice, instruct_text, prompt_text, seed, speed, stream
    PROMPT_PCM         FP32  [1, n]  optional voice reference, mono in [-1, 1] (ragged across a batch)
    PROMPT_SAMPLE_RATE INT32 [1, 1]  optional, with PROMPT_PCM
Outputs of every streamed response:
    AUDIO              FP32  [1, n]  one chunk, mono in [-1, 1]
    SAMPLE_RATE        INT32 [1, 1]
    CHUNK_INDEX        INT32 [1, 1]  0, 1, 2, ... within the request
    LAST               BOOL  [1, 1]
    TIMES              BYTES [1, 1]  JSON of the engine's StageTimes so far
Errors: a response error whose message is ``cosyedge:<kind>:<code>: <text>``,
kind ``request`` (the request cannot be served: the code is the engine's
RequestError code, e.g. ``unknown_voice``) or ``engine`` (a run-time failure).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
from cosyedge_models.synthesis.api import PromptAudio, SynthesisRequest
from cosyedge_models.synthesis.modes import MODES

INPUTS = ("TEXT", "PARAMS", "PROMPT_PCM", "PROMPT_SAMPLE_RATE")
OUTPUTS = ("AUDIO", "SAMPLE_RATE", "CHUNK_INDEX", "LAST", "TIMES")
_ERROR_RE = re.compile(r"cosyedge:(request|engine):([A-Za-z0-9_.-]+): (.*)", re.S)


def _bytes_tensor(value: str) -> np.ndarray:
    return np.array([[value.encode("utf-8")]], dtype=np.object_)


def request_tensors(
    text: str,
    *,
    mode: str = "sft",
    voice: str | None = None,
    instruct_text: str | None = None,
    prompt_pcm: np.ndarray | None = None,
    prompt_sample_rate: int | None = None,
    prompt_text: str = "",
    seed: int | None = None,
    speed: float = 1.0,
    stream: bool = True,
) -> dict[str, np.ndarray]:
    params = {
        "mode": mode,
        "voice": voice,
        "instruct_text": instruct_text,
        "prompt_text": prompt_text,
        "seed": seed,
        "speed": speed,
        "stream": stream,
    }
    tensors = {"TEXT": _bytes_tensor(text), "PARAMS": _bytes_tensor(json.dumps(params))}
    if prompt_pcm is not None:
        if prompt_sample_rate is None:
            raise ValueError("prompt_pcm needs prompt_sample_rate")
        tensors["PROMPT_PCM"] = np.asarray(prompt_pcm, dtype=np.float32).reshape(1, -1)
        tensors["PROMPT_SAMPLE_RATE"] = np.array([[prompt_sample_rate]], dtype=np.int32)
    return tensors


class BadTensors(ValueError):
    """The tensors of a request do not follow the contract above."""


def _scalar_str(tensors: dict[str, np.ndarray], name: str) -> str:
    arr = tensors.get(name)
    if arr is None or arr.size != 1:
        raise BadTensors(f"input {name} must hold exactly one string")
    item = arr.reshape(-1)[0]
    try:
        return item.decode("utf-8") if isinstance(item, bytes) else str(item)
    except UnicodeDecodeError:
        raise BadTensors(f"input {name} is not UTF-8") from None


def synthesis_request(tensors: dict[str, np.ndarray]) -> SynthesisRequest:
    """The engine's request from one row's tensors (model side)."""
    text = _scalar_str(tensors, "TEXT")
    try:
        params: dict[str, Any] = json.loads(_scalar_str(tensors, "PARAMS"))
    except json.JSONDecodeError as exc:
        raise BadTensors(f"input PARAMS is not JSON: {exc}") from None
    if not isinstance(params, dict):
        raise BadTensors("input PARAMS must be a JSON object")
    mode = params.get("mode") or "sft"
    if mode not in MODES:
        raise BadTensors(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    prompt = None
    pcm = tensors.get("PROMPT_PCM")
    if pcm is not None and pcm.size > 0:
        rate = tensors.get("PROMPT_SAMPLE_RATE")
        if rate is None or rate.size != 1:
            raise BadTensors("PROMPT_PCM needs PROMPT_SAMPLE_RATE")
        prompt = PromptAudio(
            pcm=np.ascontiguousarray(pcm.reshape(-1), dtype=np.float32),
            sample_rate=int(rate.reshape(-1)[0]),
            text=str(params.get("prompt_text") or ""),
        )
    seed = params.get("seed")
    return SynthesisRequest(
        text=text,
        mode=mode,
        voice=params.get("voice"),
        instruct_text=params.get("instruct_text"),
        prompt=prompt,
        stream=bool(params.get("stream", True)),
        seed=None if seed is None else int(seed),
        speed=float(params.get("speed", 1.0)),
    )


@dataclass(frozen=True)
class ModelChunk:
    pcm: np.ndarray
    sample_rate: int
    index: int
    last: bool
    times: dict[str, Any]
    model_version: str = ""


def response_tensors(
    pcm: np.ndarray, sample_rate: int, index: int, last: bool, times: dict[str, Any]
) -> dict[str, np.ndarray]:
    return {
        "AUDIO": np.asarray(pcm, dtype=np.float32).reshape(1, -1),
        "SAMPLE_RATE": np.array([[sample_rate]], dtype=np.int32),
        "CHUNK_INDEX": np.array([[index]], dtype=np.int32),
        "LAST": np.array([[last]], dtype=np.bool_),
        "TIMES": _bytes_tensor(json.dumps(times)),
    }


def model_chunk(outputs: dict[str, np.ndarray], model_version: str = "") -> ModelChunk:
    """A chunk from one response's outputs (bridge side)."""
    try:
        times_raw = outputs["TIMES"].reshape(-1)[0]
        times = json.loads(times_raw.decode() if isinstance(times_raw, bytes) else times_raw)
        return ModelChunk(
            pcm=outputs["AUDIO"].reshape(-1).astype(np.float32, copy=False),
            sample_rate=int(outputs["SAMPLE_RATE"].reshape(-1)[0]),
            index=int(outputs["CHUNK_INDEX"].reshape(-1)[0]),
            last=bool(outputs["LAST"].reshape(-1)[0]),
            times=times if isinstance(times, dict) else {},
            model_version=model_version,
        )
    except (KeyError, IndexError, ValueError) as exc:
        raise BadTensors(f"model response lacks or garbles an output: {exc}") from None


def error_message(kind: str, code: str, text: str) -> str:
    return f"cosyedge:{kind}:{code}: {text}"


def parse_error(message: str) -> tuple[str, str, str] | None:
    """(kind, code, text) of a model error, None when it is not one of ours
    (then it came from Triton itself: a load failure, a queue timeout ...)."""
    m = _ERROR_RE.search(message)
    return (m.group(1), m.group(2), m.group(3)) if m else None
