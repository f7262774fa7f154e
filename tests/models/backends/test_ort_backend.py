"""The onnxruntime backend's IOBinding decode loop (the KV cache stays a
runtime tensor between steps, on the GPU with the CUDA provider) against the
plain host loop, on the tiny bundle. Here it runs with device "cpu"; on a GPU
machine `pytest -m gpu` runs the same comparison on the CUDA provider."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cosyedge_models.backends.base import HostDecodeLoop
from cosyedge_models.backends.factory import create_backend
from cosyedge_models.backends.ort import BoundDecodeLoop, OrtBackend, OrtSession
from cosyedge_models.bundle.loader import load_bundle

from tests.support.components import require_cuda_provider


def _embeds(d: int, n_steps: int) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(7)
    prompt = rng.standard_normal((1, 5, d)).astype(np.float32)
    steps = [rng.standard_normal((1, 1, d)).astype(np.float32) for _ in range(n_steps)]
    return prompt, steps


def _compare(backend: OrtBackend, bundle_dir: Path, device: str) -> None:
    bundle = load_bundle(bundle_dir)
    pre = backend.load("llm_prefill", bundle.stages["llm_prefill"].path)
    dec = backend.load("llm_decode", bundle.stages["llm_decode"].path)
    prompt, steps = _embeds(bundle.llm.hidden_size, 12)
    host = HostDecodeLoop(pre, dec)
    bound = BoundDecodeLoop(pre, dec, device)
    expected = [host.prefill(prompt)] + [host.step(x) for x in steps]
    got = [bound.prefill(prompt)] + [bound.step(x) for x in steps]
    assert bound.cache_len == host.cache_len == 5 + 12
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4, err_msg=f"step {i}")
    bound.close()
    assert bound.cache_len == 0
    with pytest.raises(RuntimeError, match="before prefill"):
        bound.step(steps[0])


def test_bound_loop_matches_host_loop_on_cpu(tiny_bundle: Path) -> None:
    backend = create_backend("ort")
    assert isinstance(backend, OrtBackend)
    _compare(backend, tiny_bundle, "cpu")


def test_cpu_backend_keeps_host_loop(tiny_bundle: Path) -> None:
    bundle = load_bundle(tiny_bundle)
    backend = create_backend("ort")
    pre = backend.load("llm_prefill", bundle.stages["llm_prefill"].path)
    dec = backend.load("llm_decode", bundle.stages["llm_decode"].path)
    assert isinstance(pre, OrtSession) and not pre.on_device
    assert isinstance(backend.decode_loop(pre, dec), HostDecodeLoop)


@pytest.mark.gpu
def test_bound_loop_on_cuda_provider(tiny_bundle: Path) -> None:
    require_cuda_provider()
    backend = create_backend("ort-cuda")
    assert isinstance(backend, OrtBackend)
    bundle = load_bundle(tiny_bundle)
    dec = backend.load("llm_decode", bundle.stages["llm_decode"].path)
    assert dec.on_device, dec.providers
    pre = backend.load("llm_prefill", bundle.stages["llm_prefill"].path)
    assert isinstance(backend.decode_loop(pre, dec), BoundDecodeLoop)
    _compare(backend, tiny_bundle, "cuda")


def test_cudnn_options_default_and_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    from cosyedge_models.backends.ort import cudnn_options
    from cosyedge_models.errors import BundleError

    monkeypatch.delenv("COSYEDGE_ORT_CUDNN_SEARCH", raising=False)
    monkeypatch.delenv("COSYEDGE_ORT_CONV1D_PAD_NC1D", raising=False)
    assert cudnn_options() == {"cudnn_conv_algo_search": "HEURISTIC"}
    monkeypatch.setenv("COSYEDGE_ORT_CUDNN_SEARCH", "exhaustive")
    monkeypatch.setenv("COSYEDGE_ORT_CONV1D_PAD_NC1D", "1")
    assert cudnn_options() == {"cudnn_conv_algo_search": "EXHAUSTIVE", "cudnn_conv1d_pad_to_nc1d": "1"}
    monkeypatch.setenv("COSYEDGE_ORT_CUDNN_SEARCH", "fastest")
    with pytest.raises(BundleError, match="allowed values"):
        cudnn_options()


def test_cpu_memory_arena_setting_reaches_every_session(tiny_bundle: Path) -> None:
    """SynthesisSettings.cpu_memory_arena (default off) is what each onnxruntime session runs with."""
    from cosyedge_models.synthesis.api import SynthesisRequest
    from cosyedge_models.synthesis.settings import SynthesisSettings
    from cosyedge_models.synthesis.synthesizer import load_synthesizer

    for arena in (False, True):
        engine = load_synthesizer(tiny_bundle, settings=SynthesisSettings(cpu_memory_arena=arena))
        try:
            sessions = [s for s in engine._sessions if isinstance(s, OrtSession)]
            assert len(sessions) >= 6
            assert {s.cpu_memory_arena for s in sessions} == {arena}
            assert engine.backend.describe()["cpu_memory_arena"] == ("on" if arena else "off")
            audio = np.concatenate([c.pcm for c in engine.synthesize(SynthesisRequest(text="Hello there.", seed=0))])
            assert audio.size > 0 and np.isfinite(audio).all()
        finally:
            engine.close()
    assert SynthesisSettings().cpu_memory_arena is False
