"""The fixed-size LLM decode step (build export --static-decode-len) and its
loop (models/backends/ort_graph_decode.py): every shape in the graph is
static (what lets onnxruntime's CUDA provider capture it), it computes what
the dynamic step computes, the engine's output does not change with it, and
requests that do not fit (too long, all slots busy) use the ordinary loop.
On the CPU the loop runs without capture; `-m gpu` runs it with CUDA graphs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from cosyedge_models.backends.base import HostDecodeLoop
from cosyedge_models.backends.factory import create_backend
from cosyedge_models.backends.graph_thread import GraphThread
from cosyedge_models.backends.ort import OrtBackend
from cosyedge_models.backends.ort_graph_decode import GraphDecodeLoop, GraphDecoder
from cosyedge_models.bundle.loader import load_bundle
from cosyedge_models.errors import BundleError, SynthesisError
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import load_synthesizer

from tests.conftest import STATIC_DECODE_LEN
from tests.support.components import require_cuda_provider
from tests.support.concurrent import run_concurrently


def test_static_step_has_only_fixed_shapes(tiny_static_bundle: Path) -> None:
    model = onnx.load(str(tiny_static_bundle / "llm_decode_static.onnx"), load_external_data=False)
    for value in [*model.graph.input, *model.graph.output]:
        dims = value.type.tensor_type.shape.dim
        assert all(d.HasField("dim_value") for d in dims), value.name
    ops = {n.op_type for n in model.graph.node}
    # shape arithmetic is what onnxruntime moves to the CPU (and what blocks capture)
    assert not ops & {"Shape", "Size", "NonZero"}, ops
    assert model.graph.input[2].type.tensor_type.shape.dim[4].dim_value == STATIC_DECODE_LEN


def _decoder(bundle_dir: Path, device: str = "cpu", slots: int = 2) -> tuple[GraphDecoder, OrtBackend, dict]:
    bundle = load_bundle(bundle_dir)
    backend = create_backend("ort" if device == "cpu" else "ort-cuda")
    assert isinstance(backend, OrtBackend)
    sessions = {s: backend.load(s, bundle.stages[s].path, threads=1)
                for s in ("llm_prefill", "llm_decode", "llm_decode_static", "llm_kv_pad")}
    dec = GraphDecoder(sessions["llm_prefill"], sessions["llm_decode_static"], sessions["llm_kv_pad"],
                       (device, 0), GraphThread().start(), slots)
    return dec, backend, sessions


def _compare_with_dynamic(bundle_dir: Path, device: str, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    dec, _, sessions = _decoder(bundle_dir, device)
    dec.warm_up()  # as the engine does: both slots made and (on a GPU) captured on the graph thread
    bundle = load_bundle(bundle_dir)
    rng = np.random.default_rng(0)
    d = bundle.llm.hidden_size
    prompt = (rng.standard_normal((1, 17, d)) * 0.05).astype(np.float32)
    steps = [(rng.standard_normal((1, 1, d)) * 0.05).astype(np.float32) for _ in range(40)]
    host = HostDecodeLoop(sessions["llm_prefill"], sessions["llm_decode"])
    loop = dec.loop(17 + len(steps) + 1)
    assert isinstance(loop, GraphDecodeLoop)
    try:
        np.testing.assert_allclose(loop.prefill(prompt), host.prefill(prompt), atol=atol)
        for e in steps:
            np.testing.assert_allclose(loop.step(e), host.step(e), atol=atol, rtol=rtol)
        assert loop.cache_len == host.cache_len == 17 + len(steps)
    finally:
        loop.close()
        dec.close()
        dec.thread.close()
        for s in sessions.values():
            s.close()


def test_fixed_size_loop_matches_the_dynamic_step(tiny_static_bundle: Path) -> None:
    _compare_with_dynamic(tiny_static_bundle, "cpu")


@pytest.mark.gpu
def test_cuda_graph_loop_matches_the_dynamic_step(tiny_static_bundle: Path) -> None:
    require_cuda_provider()
    _compare_with_dynamic(tiny_static_bundle, "cuda")


def test_requests_that_do_not_fit_use_the_ordinary_loop(tiny_static_bundle: Path) -> None:
    dec, _, sessions = _decoder(tiny_static_bundle, slots=2)
    try:
        assert dec.loop(STATIC_DECODE_LEN + 1) is None  # may outgrow the cache
        a, b = dec.loop(10), dec.loop(10)
        assert a is not None and b is not None
        assert dec.loop(10) is None  # both slots busy
        a.close()
        c = dec.loop(10)
        assert c is not None  # a's slot is free again
        d = sessions["llm_decode_static"].input_shapes["inputs_embeds"][2]
        with pytest.raises(SynthesisError, match="does not fit"):
            c.prefill(np.zeros((1, STATIC_DECODE_LEN, d), np.float32))
        c.prefill(np.zeros((1, STATIC_DECODE_LEN - 1, d), np.float32))
        c.step(np.zeros((1, 1, d), np.float32))  # the last position
        with pytest.raises(SynthesisError, match="full"):
            c.step(np.zeros((1, 1, d), np.float32))
        b.close()
        c.close()
    finally:
        dec.close()
        dec.thread.close()
        for s in sessions.values():
            s.close()


def test_engine_output_is_the_same_with_the_fixed_size_loop(tiny_static_bundle: Path) -> None:
    request = SynthesisRequest(text="Fixed shapes, same voice.", stream=False, seed=11)
    results = {}
    for on in (False, True):
        engine = load_synthesizer(tiny_static_bundle, settings=SynthesisSettings(threads=1, overlap_stages=False,
                                                                         graph_decode=on))
        try:
            assert (engine.lm.fixed_size_decode is not None) == on
            chunks = list(engine.synthesize(request))
        finally:
            engine.close()
        results[on] = (chunks[-1].times.llm_tokens, np.concatenate([c.pcm for c in chunks]))
    assert results[True][0] == results[False][0] > 0
    np.testing.assert_allclose(results[True][1], results[False][1], atol=1e-4)


def test_auto_is_off_on_the_cpu_and_forcing_it_needs_the_step(tiny_bundle: Path, tiny_static_bundle: Path) -> None:
    engine = load_synthesizer(tiny_static_bundle, settings=SynthesisSettings(threads=1))
    try:
        assert engine.lm.fixed_size_decode is None  # auto: ort-cuda only
    finally:
        engine.close()
    with pytest.raises(BundleError, match="static-decode-len"):
        load_synthesizer(tiny_bundle, settings=SynthesisSettings(threads=1, graph_decode=True))


def _concurrent_loops(bundle_dir: Path, device: str, n: int) -> None:
    """n threads decode at once through the slots (captured at load on the
    graph thread): every step's logp equals the same request decoded alone."""
    dec, _, sessions = _decoder(bundle_dir, device, slots=n)
    d = load_bundle(bundle_dir).llm.hidden_size
    rng = np.random.default_rng(3)
    prompts = [(rng.standard_normal((1, 5 + i, d)) * 0.05).astype(np.float32) for i in range(n)]
    steps = [[(rng.standard_normal((1, 1, d)) * 0.05).astype(np.float32) for _ in range(30)] for _ in range(n)]

    def decode(i: int) -> list[np.ndarray]:
        loop = dec.loop(64)
        assert isinstance(loop, GraphDecodeLoop)
        try:
            return [loop.prefill(prompts[i]), *(loop.step(e) for e in steps[i])]
        finally:
            loop.close()

    try:
        dec.warm_up()
        serial = [decode(i) for i in range(n)]
        concurrent = run_concurrently(n, decode, timeout_s=300)
    finally:
        dec.close()
        dec.thread.close()
        for s in sessions.values():
            s.close()
    for i in range(n):
        for a, b in zip(concurrent[i], serial[i], strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 if device == "cpu" else 1e-5)


def test_concurrent_requests_on_the_fixed_size_loop_match_serial_ones(tiny_static_bundle: Path) -> None:
    _concurrent_loops(tiny_static_bundle, "cpu", 4)


@pytest.mark.gpu
def test_cuda_graph_loop_eight_concurrent_requests_match_serial(tiny_static_bundle: Path) -> None:
    require_cuda_provider()
    _concurrent_loops(tiny_static_bundle, "cuda", 8)
