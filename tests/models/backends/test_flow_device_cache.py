"""Streaming flow caches bound by IOBinding (models/backends/ort_cache.py)
against the host caches on the tiny bundle: the same mel for every chunk,
through growth past the preallocated capacity, the bounded left context and
fp16 caches, and the buffers released by close(). Here the bound store runs
with device "cpu"; `pytest -m gpu` runs it on the CUDA provider."""

from __future__ import annotations

import dataclasses
import weakref
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from cosyedge_models.backends.base import Session
from cosyedge_models.backends.factory import create_backend
from cosyedge_models.backends.flow_cache import HostStepCache, StepCache, StepCacheSpec
from cosyedge_models.backends.ort import OrtBackend
from cosyedge_models.backends.ort_cache import (
    BoundCacheFactory,
    BoundStepCache,
    DeviceCopier,
    copy_runs,
    identity_model,
    lane_layout_model,
)
from cosyedge_models.bundle.loader import load_bundle
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.flow import CacheFactory, FlowDecoder, FlowPrompt
from cosyedge_models.synthesis.streaming import ChunkSchedule
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer

from tests.support.components import require_cuda_provider, require_module
from tests.support.module_tmp import ModuleTmp
from tests.support.trt_emulator import Emulation


class Recording:
    """A cache factory that keeps what it made (optionally with a smaller
    initial capacity, to force growth)."""

    def __init__(self, inner: CacheFactory, initial_frames: int | None = None) -> None:
        self.inner = inner
        self.initial_frames = initial_frames
        self.made: list[StepCache] = []

    def __call__(self, session: Session, spec: StepCacheSpec) -> StepCache:
        if self.initial_frames is not None:
            spec = dataclasses.replace(spec, initial_frames=self.initial_frames)
        cache = self.inner(session, spec)
        self.made.append(cache)
        return cache


@pytest.fixture(scope="module")
def prompt(engine: CosyVoiceSynthesizer) -> FlowPrompt:
    return engine.conditioning.build(SynthesisRequest(text="x")).flow


def stream_mel(decoder: FlowDecoder, prompt: FlowPrompt, toks: np.ndarray, left: int = -1,
               hop: int = 25) -> tuple[np.ndarray, list[int]]:
    """All mel chunks of one streaming request (cached final chunk), and the
    committed frames held by step 0's cache after each call."""
    look = decoder.config.pre_lookahead_len
    schedule = ChunkSchedule(hop, look, prompt_tokens=len(prompt.tokens))
    mels, held = [], []
    with decoder.stream(prompt, "cached", left) as stream:
        while (chunk := schedule.next_chunk(len(toks))) is not None:
            mels.append(stream.push(toks[: chunk.end + look]))
            held.append(stream.caches[0].length)
        mels.append(stream.finish(toks))
    return np.concatenate(mels, axis=2), held


def decoder_with(engine: CosyVoiceSynthesizer, factory: CacheFactory) -> FlowDecoder:
    return FlowDecoder(engine.bundle, engine.flow.encoder, engine.flow.estimator, factory)


def test_identity_model_copies_byte_ranges() -> None:
    try:
        import onnx

        onnx.checker.check_model(onnx.load_from_string(identity_model()))
    except ImportError:
        pass  # the runtime below is the check that matters
    copier = DeviceCopier("cpu")
    src = ort.OrtValue.ortvalue_from_numpy(np.arange(12, dtype=np.float32))
    dst = ort.OrtValue.ortvalue_from_numpy(np.full(12, -1.0, dtype=np.float32))
    copier.copy(dst.data_ptr() + 2 * 4, src.data_ptr() + 5 * 4, 4 * 4)
    copier.copy(dst.data_ptr(), src.data_ptr(), 0)  # nothing
    np.testing.assert_array_equal(dst.numpy(), [-1, -1, 5, 6, 7, 8, -1, -1, -1, -1, -1, -1])


def test_copy_many_runs_every_copy_of_a_batch_in_one_graph() -> None:
    """A lane's 2 L block copies in one session run (one Identity node each), as separate copies."""
    try:
        import onnx

        onnx.checker.check_model(onnx.load_from_string(identity_model(3)))
    except ImportError:
        pass  # the runtime below is the check that matters
    copier = DeviceCopier("cpu")
    src = ort.OrtValue.ortvalue_from_numpy(np.arange(20, dtype=np.float32))
    many = ort.OrtValue.ortvalue_from_numpy(np.full(20, -1.0, dtype=np.float32))
    one_by_one = ort.OrtValue.ortvalue_from_numpy(np.full(20, -1.0, dtype=np.float32))
    ranges = [(0, 10, 3), (5, 2, 4), (12, 0, 2), (18, 18, 0)]  # (dst, src, floats): strided, one empty
    copier.copy_many([(many.data_ptr() + 4 * d, src.data_ptr() + 4 * s, 4 * n) for d, s, n in ranges])
    for d, s, n in ranges:
        copier.copy(one_by_one.data_ptr() + 4 * d, src.data_ptr() + 4 * s, 4 * n)
    np.testing.assert_array_equal(many.numpy(), one_by_one.numpy())
    np.testing.assert_array_equal(many.numpy()[:9], [10, 11, 12, -1, -1, 2, 3, 4, 5])
    assert sorted(copier._many) == [2]  # three copies: a run of two and the plain graph
    copier.copy_many([(many.data_ptr(), src.data_ptr() + 4, 4)] * 1)  # one copy: the plain graph
    assert many.numpy()[0] == 1 and sorted(copier._many) == [2]


def test_copy_many_makes_a_graph_for_a_few_run_sizes_only() -> None:
    """Every count from 1 to 130 copies right, through at most the six run sizes' graphs (a graph a
    count would have made 129 sessions, each a cuBLAS handle and workspace on a GPU)."""
    assert copy_runs(0) == [] and copy_runs(1) == [1] and copy_runs(3) == [2, 1]
    assert copy_runs(112) == [64, 32, 16] and copy_runs(127) == [64, 32, 16, 8, 4, 2, 1]
    assert copy_runs(130) == [64, 64, 2]
    copier = DeviceCopier("cpu")
    src = ort.OrtValue.ortvalue_from_numpy(np.arange(260, dtype=np.float32))
    for count in range(1, 131):
        dst = ort.OrtValue.ortvalue_from_numpy(np.full(260, -1.0, dtype=np.float32))
        # copy i: source floats [2i, 2i + 2) to destination floats [258 - 2i, 260 - 2i)
        copier.copy_many([(dst.data_ptr() + 4 * (258 - 2 * i), src.data_ptr() + 8 * i, 8) for i in range(count)])
        got = dst.numpy()
        for i in range(count):
            np.testing.assert_array_equal(got[258 - 2 * i:260 - 2 * i], [2 * i, 2 * i + 1])
        assert (got[:258 - 2 * (count - 1)] == -1).all()
    assert sorted(copier._many) == [2, 4, 8, 16, 32, 64]


def test_lane_layout_model_transposes_and_pads_a_prefix() -> None:
    import onnx

    model = lane_layout_model([1, 2, 3, 4, 0, 5])
    onnx.checker.check_model(onnx.load_from_string(model))  # the hand-written protobuf is a valid model
    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    src = np.random.default_rng(2).standard_normal((5, 3, 2, 2, 4, 6)).astype(np.float32)  # [n, L, 2, 2, H, D]
    pads = np.zeros(12, np.int64)
    pads[6 + 4] = 7  # the frames axis padded at its end, to 12 frames
    (dst,) = sess.run(None, {"src": src, "pads": pads})
    assert dst.shape == (3, 2, 2, 4, 12, 6)
    np.testing.assert_array_equal(dst[:, :, :, :, :5], src.transpose(1, 2, 3, 4, 0, 5))
    assert not dst[:, :, :, :, 5:].any()


def test_cpu_backend_keeps_host_caches(engine: CosyVoiceSynthesizer) -> None:
    backend = create_backend("ort")
    assert isinstance(backend, OrtBackend)
    cache = backend.flow_cache(engine.flow.estimator, engine.flow.cache_spec())
    assert isinstance(cache, HostStepCache)


@pytest.mark.parametrize(("left", "initial"), [(-1, None), (-1, 1), (1, 1), (2, None)],
                         ids=["full-context", "full-context-grows", "left-1-grows", "left-2"])
def test_bound_caches_give_the_host_mel(engine: CosyVoiceSynthesizer, prompt: FlowPrompt, left: int,
                                        initial: int | None) -> None:
    toks = np.random.default_rng(11).integers(0, engine.bundle.llm.speech_token_size, 190)
    host, host_held = stream_mel(engine.flow, prompt, toks, left)
    bound_factory = Recording(BoundCacheFactory("cpu"), initial)
    bound, bound_held = stream_mel(decoder_with(engine, bound_factory), prompt, toks, left)
    assert bound.shape == host.shape and bound.shape[2] == 2 * len(toks)
    np.testing.assert_allclose(bound, host, rtol=0, atol=1e-6)
    caches = bound_factory.made
    assert len(caches) == engine.bundle.flow.n_timesteps
    bound_caches = [c for c in caches if isinstance(c, BoundStepCache)]
    assert len(bound_caches) == len(caches)
    if left < 0:
        assert bound_held == host_held  # every committed frame stays
        # the buffers grew past their preallocation by doubling (device copies included)
        assert bound_held[-1] > bound_caches[0].spec.initial_frames
        assert all(c.growths >= 1 for c in bound_caches)
    else:
        # trimmed (moved to the front by a device copy) as the left context allows
        assert any(b < a for a, b in zip(bound_held, bound_held[1:], strict=False))
    assert all(c.nbytes() == 0 for c in bound_caches)  # closed when the stream's `with` ended


def test_close_releases_the_device_buffers(engine: CosyVoiceSynthesizer, prompt: FlowPrompt) -> None:
    factory = Recording(BoundCacheFactory("cpu"))
    decoder = decoder_with(engine, factory)
    toks = np.arange(60) % engine.bundle.llm.speech_token_size
    stream = decoder.stream(prompt, "cached")
    stream.push(toks[:40])
    cache = factory.made[0]
    assert isinstance(cache, BoundStepCache) and cache.length > 0
    row = cache.spec.row_bytes
    assert stream.cache_bytes() >= len(factory.made) * cache.capacity * row
    buffers = [weakref.ref(c.rows.buffer) for c in factory.made if isinstance(c, BoundStepCache)]
    assert all(b() is not None for b in buffers)
    stream.close()
    assert all(b() is None for b in buffers)  # no reference left anywhere: the memory is back with onnxruntime
    assert stream.cache_bytes() == 0
    stream.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        stream.push(toks)
    with pytest.raises(RuntimeError, match="after close"):
        cache.run({}, 0)


def test_engine_closes_the_stream_caches(engine: CosyVoiceSynthesizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the engine: the caches a streaming request made are released
    when it ends, and when its consumer stops after the first chunk."""
    factory = Recording(BoundCacheFactory("cpu"))
    monkeypatch.setattr(engine.flow, "cache_factory", factory)
    text = "Hello from the tiny model, one two three, four five six."
    chunks = list(engine.synthesize(SynthesisRequest(text=text, seed=4, stream=True)))
    assert len(chunks) >= 2 and chunks[-1].last
    assert factory.made and all(c.nbytes() == 0 for c in factory.made)
    factory.made.clear()
    gen = engine.synthesize(SynthesisRequest(text=text, seed=4, stream=True))
    next(gen)
    assert factory.made and any(c.nbytes() > 0 for c in factory.made)
    gen.close()  # type: ignore[attr-defined]  # a generator
    assert all(c.nbytes() == 0 for c in factory.made)


@pytest.fixture(scope="module")
def fp16_flow_bundle(tiny_bundle: Path, module_tmp: ModuleTmp) -> Path:
    """The tiny bundle with only its estimator in fp16 (fp16 K/V cache I/O)."""
    require_module("onnx")
    from cosyedge_build.quantize.fp16 import FP16_IO, convert_fp16
    from cosyedge_build.quantize.writer import add_variants, link_bundle

    out = module_tmp.mktemp("fp16flow")
    link_bundle(tiny_bundle, out)
    est = out / "flow_estimator.fp16.onnx"
    convert_fp16(tiny_bundle / "flow_estimator.onnx", est, (), FP16_IO["flow_estimator"])
    add_variants(out, "fp16", {"flow_estimator": est}, {}, "report.json")
    return out


def test_bound_fp16_caches_give_the_host_mel(fp16_flow_bundle: Path, prompt: FlowPrompt) -> None:
    bundle = load_bundle(fp16_flow_bundle, precision="fp16")
    backend = create_backend("ort")
    enc = backend.load("flow_encoder", bundle.stages["flow_encoder"].path)
    est = backend.load("flow_estimator", bundle.stages["flow_estimator"].path)
    try:
        host_dec = FlowDecoder(bundle, enc, est)
        assert host_dec.cache_dtype == np.float16
        factory = Recording(BoundCacheFactory("cpu"), 1)
        toks = np.random.default_rng(12).integers(0, bundle.llm.speech_token_size, 120)
        host, _ = stream_mel(host_dec, prompt, toks)
        bound, _ = stream_mel(FlowDecoder(bundle, enc, est, factory), prompt, toks)
        assert np.isfinite(host).all()
        np.testing.assert_allclose(bound, host, rtol=0, atol=1e-6)
        assert all(isinstance(c, BoundStepCache) and c.spec.dtype == np.float16 and c.growths for c in factory.made)
    finally:
        enc.close()
        est.close()


@pytest.mark.gpu
def test_bound_caches_on_cuda_provider(tiny_bundle: Path) -> None:
    """ort-cuda picks the device store; its mel equals the host caches' on the
    same CUDA sessions (within float noise of the GPU kernels), and a
    streaming request through the engine runs on it."""
    require_cuda_provider()
    from cosyedge_models.synthesis.settings import SynthesisSettings
    from cosyedge_models.synthesis.synthesizer import load_synthesizer

    eng = load_synthesizer(tiny_bundle, "ort-cuda", SynthesisSettings(backend="ort-cuda"))
    try:
        est = eng.flow.estimator
        assert getattr(est, "on_device", False)
        made = Recording(eng.backend.flow_cache, 1)
        prompt = eng.conditioning.build(SynthesisRequest(text="x")).flow
        toks = np.random.default_rng(13).integers(0, eng.bundle.llm.speech_token_size, 190)
        for left in (-1, 1):
            host, host_held = stream_mel(decoder_with(eng, HostStepCache), prompt, toks, left)
            bound, held = stream_mel(decoder_with(eng, made), prompt, toks, left)
            assert held == host_held
            np.testing.assert_allclose(bound, host, rtol=0, atol=1e-4)
        assert made.made and all(isinstance(c, BoundStepCache) and c.nbytes() == 0 for c in made.made)
        assert all(c.growths for c in made.made if isinstance(c, BoundStepCache) and c.spec.visible < 0)
        # the engine's own factory is the backend's: device caches, closed at the end
        through_engine = Recording(eng.flow.cache_factory)
        eng.flow.cache_factory = through_engine
        chunks = list(eng.synthesize(SynthesisRequest(text="Hello from the GPU, one two three.", seed=1,
                                                      stream=True)))
        assert chunks[-1].last and np.isfinite(np.concatenate([c.pcm for c in chunks])).all()
        assert through_engine.made and all(isinstance(c, BoundStepCache) and c.nbytes() == 0
                                           for c in through_engine.made)
    finally:
        eng.close()


def test_a_fixed_buffer_is_host_memory_on_cpu_and_driver_memory_on_cuda(emulated_tensorrt: Emulation) -> None:
    """FixedBuffer: the lanes' and slots' caches bound by pointer; on "cuda" exactly their bytes from
    the driver (the emulated libcuda counts them), read back whole, freed by close()."""
    from cosyedge_models.backends.ort_cache import FixedBuffer

    host = FixedBuffer((3, 5), np.float16, ("cpu", 0))
    assert host.nbytes == 30 and host.numpy().dtype == np.float16 and not host.numpy().any()
    before = emulated_tensorrt.device_bytes()
    dev = FixedBuffer((1000, 3), np.float32, ("cuda", 0))
    assert emulated_tensorrt.device_bytes() - before == 12_000
    emulated_tensorrt.machine.span(dev.ptr + 4 * 4, 4, "test")[:] = np.frombuffer(np.float32(2.5).tobytes(), np.uint8)
    back = dev.numpy()
    assert back.shape == (1000, 3) and back[1, 1] == 2.5 and back.sum() == 2.5
    dev.close()
    assert emulated_tensorrt.device_bytes() == before
