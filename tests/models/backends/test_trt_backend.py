"""The TensorRT backend, under the emulator (tests/support/trt_emulator) in the default
run or on a real GPU with TensorRT (conftest.py's trt_runtime): engines built from the tiny
bundle with `build engines`, checked against onnxruntime on the inputs the pipeline really
feeds each stage, the device-resident decode loop (with and without CUDA graphs, across
decode buckets) against the host loop, and the whole pipeline, also from two threads at once."""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cosyedge_models.backends.base import HostDecodeLoop, Session
from cosyedge_models.backends.factory import create_backend
from cosyedge_models.bundle.loader import STAGES, load_bundle
from cosyedge_models.errors import BundleError
from cosyedge_models.synthesis.api import SynthesisRequest

from tests.support.module_tmp import ModuleTmp
from tests.support.trt_emulator import Emulation
from tests.support.trt_runtime import build_trt_bundle


@pytest.fixture(scope="module")
def trt_bundle(trt_runtime: Emulation | None, tiny_bundle: Path, module_tmp: ModuleTmp) -> Path:
    return build_trt_bundle(tiny_bundle, module_tmp.mktemp("trt") / "bundle")


class Recorder:
    """An onnxruntime session that remembers every call's inputs and outputs."""

    def __init__(self, inner: Session) -> None:
        self.inner = inner
        self.name, self.input_names, self.output_names = inner.name, inner.input_names, inner.output_names
        self.calls: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = []

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        out = self.inner.run(inputs, outputs)
        self.calls.append(({k: np.array(v) for k, v in inputs.items()}, out))
        return out

    def memory_bytes(self) -> int:
        return self.inner.memory_bytes()

    def close(self) -> None:
        self.inner.close()


def test_engines_recorded_for_this_gpu(trt_bundle: Path) -> None:
    manifest = json.loads((trt_bundle / "manifest.json").read_text())
    engines = manifest["engines"]
    assert set(engines["stages"]) == set(STAGES)
    assert (trt_bundle / "timing.cache").stat().st_size > 0
    bundle = load_bundle(trt_bundle, backend="trt")
    assert all(s.path.suffix == ".plan" for s in bundle.stages.values())
    assert bundle.verify_hashes() == []
    tampered = trt_bundle.parent / "tampered"
    shutil.copytree(trt_bundle, tampered)
    manifest["engines"]["tensorrt"] = "9.0.0"
    (tampered / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="cosyedge build engines --bundle"):
        load_bundle(tampered, backend="trt")


def _synth(engine: Any, seed: int, stream: bool = True) -> np.ndarray:
    chunks = list(engine.synthesize(SynthesisRequest(text="Hello from the board.", seed=seed, stream=stream)))
    assert chunks and chunks[-1].last
    return np.concatenate([c.pcm for c in chunks])


def test_stages_match_onnxruntime_on_pipeline_inputs(trt_bundle: Path) -> None:
    from cosyedge_models.synthesis.synthesizer import load_synthesizer

    ort_engine = load_synthesizer(trt_bundle, backend="ort")
    recorders: dict[str, Recorder] = {}
    for holder, attrs in ((ort_engine.flow, ("encoder", "estimator")),
                          (ort_engine.vocoder, ("source_session", "decoder_session"))):
        for attr in attrs:
            rec = Recorder(getattr(holder, attr))
            setattr(holder, attr, rec)
            recorders[rec.name] = rec
    _synth(ort_engine, seed=3)
    bundle = load_bundle(trt_bundle, backend="trt")
    backend = create_backend("trt")
    for name, rec in recorders.items():
        assert rec.calls, f"{name} was not called"
        sess = backend.load(name, bundle.stages[name].path)
        for inputs, expected in rec.calls[:4]:
            got = sess.run(inputs)
            for k, v in expected.items():
                assert got[k].shape == v.shape, f"{name}.{k}"
                if not v.size:  # e.g. no new cache rows on a call that commits none
                    continue
                scale = float(np.abs(v).max()) + 1e-6
                err = float(np.abs(got[k].astype(np.float64) - v).max()) / scale
                assert err < 2e-2, f"{name}.{k}: relative error {err}"
        assert sess.memory_bytes() > bundle.stages[name].path.stat().st_size
        sess.close()
    ort_engine.close()


def _decode_inputs(bundle: Any, steps: int) -> Iterator[np.ndarray]:
    rng = np.random.default_rng(0)
    emb = np.asarray(bundle.array("speech_embedding"), dtype=np.float32)
    for _ in range(steps):
        yield emb[rng.integers(0, bundle.llm.speech_token_size)][None, None]


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graphs", "plain"])
def test_decode_loop_matches_host_loop(trt_bundle: Path, graphs: bool) -> None:
    from cosyedge_models.backends.tensorrt.backend import TrtBackend

    ort_bundle = load_bundle(trt_bundle)
    ort = create_backend("ort")
    host = HostDecodeLoop(ort.load("llm_prefill", ort_bundle.stages["llm_prefill"].path),
                          ort.load("llm_decode", ort_bundle.stages["llm_decode"].path))
    bundle = load_bundle(trt_bundle, backend="trt")
    trt = TrtBackend(decode_graphs=graphs)
    loop = trt.decode_loop(trt.load("llm_prefill", bundle.stages["llm_prefill"].path),
                           trt.load("llm_decode", bundle.stages["llm_decode"].path))
    prompt = np.random.default_rng(1).standard_normal((1, 7, bundle.llm.hidden_size)).astype(np.float32)
    steps = list(_decode_inputs(ort_bundle, 140))  # crosses the 64 and 128 buckets
    for request in range(2):  # the second request reuses the thread's buffers and graphs
        pairs = [(host.prefill(prompt), loop.prefill(prompt))]
        pairs += [(host.step(x), loop.step(x)) for x in steps]
        assert loop.cache_len == host.cache_len == 7 + len(steps)
        for i, (a, b) in enumerate(pairs):
            np.testing.assert_allclose(b, a, rtol=2e-2, atol=2e-2, err_msg=f"request {request} step {i}")
        loop.close()


def test_pipeline_on_trt_is_deterministic_and_thread_safe(trt_bundle: Path) -> None:
    from cosyedge_models.synthesis.synthesizer import load_synthesizer

    engine = load_synthesizer(trt_bundle, backend="trt")
    first = _synth(engine, seed=5)
    assert first.size > 0 and np.isfinite(first).all() and np.abs(first).max() <= 1.0
    np.testing.assert_array_equal(_synth(engine, seed=5), first)
    assert _synth(engine, seed=5, stream=False).size > 0
    results: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            results[seed] = _synth(engine, seed=seed)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (5, 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    np.testing.assert_array_equal(results[5], first)
    engine.close()


@pytest.mark.parametrize("left", [-1, 1], ids=["full-context", "left-1"])
def test_device_flow_caches_give_the_host_caches_mel(trt_bundle: Path, left: int) -> None:
    """TrtStepCache (K/V and conv history in device memory, appended in place)
    against the host caches on the same engines, through growth and trims."""
    from cosyedge_models.backends.flow_cache import HostStepCache
    from cosyedge_models.backends.tensorrt.backend import TrtBackend
    from cosyedge_models.backends.tensorrt.flow_cache import TrtStepCache
    from cosyedge_models.synthesis.flow import FlowDecoder, FlowPrompt
    from cosyedge_models.synthesis.streaming import ChunkSchedule

    bundle = load_bundle(trt_bundle, backend="trt")
    trt = TrtBackend()
    enc = trt.load("flow_encoder", bundle.stages["flow_encoder"].path)
    est = trt.load("flow_estimator", bundle.stages["flow_estimator"].path)
    rng = np.random.default_rng(4)
    prompt = FlowPrompt(tokens=np.arange(10, dtype=np.int64), embedding=rng.standard_normal(192).astype(np.float32),
                        feat=rng.standard_normal((20, bundle.mel_bins)).astype(np.float32))
    toks = rng.integers(0, bundle.llm.speech_token_size, 120)
    made: list[Any] = []

    def device(session: Session, spec: Any) -> Any:
        made.append(trt.flow_cache(session, dataclasses.replace(spec, initial_frames=1)))
        return made[-1]

    def stream(factory: Any) -> np.ndarray:
        dec = FlowDecoder(bundle, enc, est, factory)
        look = dec.config.pre_lookahead_len
        schedule = ChunkSchedule(25, look, prompt_tokens=len(prompt.tokens))
        mels = []
        with dec.stream(prompt, "cached", left) as s:
            while (chunk := schedule.next_chunk(len(toks))) is not None:
                mels.append(s.push(toks[: chunk.end + look]))
            mels.append(s.finish(toks))
        return np.concatenate(mels, axis=2)

    host = stream(lambda session, spec: HostStepCache(session, spec))
    dev = stream(device)
    assert made and all(isinstance(c, TrtStepCache) for c in made)
    if left < 0:
        assert all(c.growths >= 1 for c in made)
    np.testing.assert_allclose(dev, host, rtol=0, atol=1e-4)
