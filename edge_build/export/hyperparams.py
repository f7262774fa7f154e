"""Every hyper-parameter the runtime needs, read from the loaded upstream
modules (never assumed from a model size)."""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from typing import Any

from cosyedge_build.export.hift import upsample_factor
from cosyedge_build.export.llm import llm_dims
from cosyedge_build.reference.modules import ReferenceModels
from cosyedge_models.errors import CheckpointError


def _default(func: Any, name: str) -> Any:
    param = inspect.signature(func).parameters.get(name)
    if param is None or param.default is inspect.Parameter.empty:
        raise CheckpointError(f"{func.__qualname__} has no default for '{name}'; cannot read it")
    return param.default


def _literal_kwarg(func: Any, name: str) -> int:
    """A keyword argument upstream passes as a literal in a call inside
    `func` (flow.inference calls the CFM with n_timesteps=10)."""
    match = re.search(rf"\b{name}\s*=\s*(\d+)", inspect.getsource(func))
    if match is None:
        raise CheckpointError(f"cannot find {name} in {func.__qualname__}")
    return int(match.group(1))


def sampling(llm: Any) -> dict[str, Any]:
    fn = llm.sampling
    if not isinstance(fn, functools.partial):
        raise CheckpointError(f"llm.sampling is {fn!r}; expected a partial of a sampling function")
    return {"method": fn.func.__name__, **{k: v for k, v in fn.keywords.items()}}


def streaming(refs: ReferenceModels) -> dict[str, int]:
    """Upstream keeps these on CosyVoice2Model; read them from an instance."""
    model_cls = importlib.import_module("cosyvoice.cli.model").CosyVoice2Model
    model = model_cls(refs.llm, refs.flow, refs.hift, False)
    return {
        "token_hop_len": int(model.token_hop_len),
        "mel_cache_len": int(model.mel_cache_len),
        "source_cache_len": int(model.source_cache_len),
    }


def collect(refs: ReferenceModels) -> dict[str, Any]:
    llm, flow, hift = refs.llm, refs.flow, refs.hift
    cfm = flow.decoder
    gen = hift.m_source.l_sin_gen
    dims = llm_dims(llm)
    s = dims["speech_token_size"]
    return {
        "sample_rate": int(hift.sampling_rate),
        "token_rate_hz": int(flow.input_frame_rate),
        "token_mel_ratio": int(flow.token_mel_ratio),
        "mel_bins": int(flow.output_size),
        "llm": {
            **dims,
            "eos_token": s,
            "fill_tokens": [int(t) for t in llm.stop_token_ids if int(t) != s],
            "sos_eos_index": int(llm.sos_eos),
            "task_id_index": int(llm.task_id),
            "sampling": sampling(llm),
            "min_token_text_ratio": float(_default(llm.inference, "min_token_text_ratio")),
            "max_token_text_ratio": float(_default(llm.inference, "max_token_text_ratio")),
        },
        "flow": {
            "vocab_size": int(flow.vocab_size),
            "pre_lookahead_len": int(flow.pre_lookahead_len),
            "chunk_tokens": int(flow.encoder.static_chunk_size),
            "chunk_frames": int(cfm.estimator.static_chunk_size),
            "n_timesteps": _literal_kwarg(type(flow).inference, "n_timesteps"),
            "inference_cfg_rate": float(cfm.inference_cfg_rate),
            "t_scheduler": str(cfm.t_scheduler),
            "temperature": float(_default(type(cfm).forward, "temperature")),
            "spk_embed_dim": int(flow.spk_embed_affine_layer.in_features),
            "noise_frames": int(cfm.rand_noise.shape[-1]),
        },
        "hift": {
            "upsample_factor": upsample_factor(hift),
            "harmonics": int(hift.nb_harmonics) + 1,
            "audio_limit": float(hift.audio_limit),
            "n_fft": int(hift.istft_params["n_fft"]),
            "hop_len": int(hift.istft_params["hop_len"]),
            "voiced_threshold": float(gen.voiced_threshold),
            "sine_amp": float(gen.sine_amp),
            "noise_std": float(gen.noise_std),
        },
        "streaming": streaming(refs),
    }
