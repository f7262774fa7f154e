"""Where a GPU run's time goes, in one short call (the device tool's leases
are short): stage times of one offline synthesis, the onnxruntime profile of
each stage (models/tools/ort_profile.py: kernels and host/device copies per run,
CPU fallbacks), and one flow-estimator call three ways: plain `run` with host
arrays, IOBinding with device tensors, and IOBinding with onnxruntime's CUDA
graph capture (`enable_cuda_graph`), which replays the whole call as one
graph launch when every node runs on the GPU and the shapes stay fixed.

    python -m cosyedge_build.tools.device_probe --bundle B --backend ort-cuda --out DIR

Writes DIR/probe.json and DIR/profile.txt; on a CPU (backend ort) the graph
part is skipped with its reason."""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.flow import CFG_BATCH
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer, load_synthesizer
from cosyedge_models.tools.ort_profile import PROFILE_ENV, render, summarize_dir

log = logging.getLogger(__name__)

PROBE_TEXT = "The robot reads the news."


def estimator_feeds(engine: CosyVoiceSynthesizer, frames: int, seed: int = 0) -> dict[str, np.ndarray]:
    """An offline estimator call (no caches) over `frames` mel frames."""
    flow = engine.flow
    rng = np.random.default_rng(seed)
    c = flow.mel_bins
    empty = flow.empty_cache()
    return {
        "x": rng.standard_normal((CFG_BATCH, c, frames), dtype=np.float32),
        "mask": np.ones((CFG_BATCH, 1, frames), dtype=np.float32),
        "mu": rng.standard_normal((CFG_BATCH, c, frames), dtype=np.float32),
        "t": np.full((CFG_BATCH,), 0.5, dtype=np.float32),
        "spks": rng.standard_normal((CFG_BATCH, c), dtype=np.float32),
        "cond": np.zeros((CFG_BATCH, c, frames), dtype=np.float32),
        "chunk_frames": np.zeros((CFG_BATCH,), dtype=np.int64),
        "att_cache": np.ascontiguousarray(empty.kv),
        "conv_cache": empty.conv.copy(),
        "commit": np.zeros((0,), dtype=np.float32),
    }


def _timed(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up (and, with CUDA graphs, the capture)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) * 1e3 / repeats


def estimator_ways(path: Path, feeds: dict[str, np.ndarray], repeats: int, device_id: int = 0) -> dict[str, Any]:
    """ms per estimator call: host arrays, device IOBinding, device IOBinding + CUDA graph."""
    import onnxruntime as ort

    result: dict[str, Any] = {"frames": int(feeds["x"].shape[2])}
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        result["skipped"] = "onnxruntime has no CUDAExecutionProvider here"
        return result

    def session(graph: bool) -> Any:
        opts: dict[str, str] = {"device_id": str(device_id), "cudnn_conv_algo_search": "HEURISTIC"}
        if graph:
            opts["enable_cuda_graph"] = "1"
        return ort.InferenceSession(str(path), providers=[("CUDAExecutionProvider", opts)])

    plain = session(graph=False)
    result["host_ms"] = _timed(lambda: plain.run(None, feeds), repeats)

    def bound(sess: Any) -> Callable[[], Any]:
        # fixed device buffers for every input and output: what graph replay requires
        binding = sess.io_binding()
        keep = []
        for name, value in feeds.items():
            dev = ort.OrtValue.ortvalue_from_numpy(value, "cuda", device_id)
            keep.append(dev)
            binding.bind_ortvalue_input(name, dev)
        for out in sess.get_outputs():
            binding.bind_output(out.name, "cuda", device_id)

        def call() -> Any:
            sess.run_with_iobinding(binding)
            return keep

        return call

    result["bound_ms"] = _timed(bound(plain), repeats)
    try:
        graphed = session(graph=True)
        result["cuda_graph_ms"] = _timed(bound(graphed), repeats)
    except Exception as exc:  # onnxruntime refuses graphs with CPU nodes or dynamic allocations
        result["cuda_graph_error"] = str(exc).splitlines()[0][:300]
    return result


def offline_run(bundle: Path, backend: str, settings: SynthesisSettings, request: SynthesisRequest) -> dict[str, Any]:
    """Stage times of one offline synthesis after a warm-up one (first calls allocate and pick kernels)."""
    engine = load_synthesizer(bundle, backend=backend, settings=settings)
    try:
        list(engine.synthesize(request))
        t0 = time.perf_counter()
        chunks = list(engine.synthesize(request))
        wall = time.perf_counter() - t0
        times = chunks[-1].times
        audio_s = sum(c.pcm.size for c in chunks) / engine.sample_rate
        return {"wall_s": wall, "audio_s": audio_s, "rtf": wall / max(audio_s, 1e-9),
                "fixed_size_decode": engine.lm.fixed_size_decode is not None,
                "llm_ms": times.llm_ms, "llm_tokens": times.llm_tokens,
                "llm_ms_per_token": times.llm_ms / max(times.llm_tokens, 1),
                "flow_ms": times.flow_ms, "vocoder_ms": times.vocoder_ms}
    finally:
        engine.close()


CONV_VARIANTS: dict[str, dict[str, str]] = {
    "heuristic": {"cudnn_conv_algo_search": "HEURISTIC"},  # the backend's choice
    "heuristic_pad_nc1d": {"cudnn_conv_algo_search": "HEURISTIC", "cudnn_conv1d_pad_to_nc1d": "1"},
    "exhaustive": {"cudnn_conv_algo_search": "EXHAUSTIVE"},
    "exhaustive_pad_nc1d": {"cudnn_conv_algo_search": "EXHAUSTIVE", "cudnn_conv1d_pad_to_nc1d": "1"},
}


def vocoder_feeds(engine: CosyVoiceSynthesizer, frames: int, seed: int = 0) -> dict[str, np.ndarray]:
    """One HiFT decoder call over `frames` mel frames (a random excitation stands in for the source)."""
    rng = np.random.default_rng(seed)
    voc = engine.vocoder
    return {"mel": rng.standard_normal((1, engine.bundle.mel_bins, frames), dtype=np.float32),
            "source": (0.1 * rng.standard_normal((1, 1, frames * voc.upsample))).astype(np.float32)}


def conv_variants(path: Path, feeds: dict[str, np.ndarray], repeats: int, device_id: int = 0) -> dict[str, Any]:
    """ms per call of one graph under the cuDNN settings of CONV_VARIANTS (its convolutions dominate on the GPU)."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return {"skipped": "onnxruntime has no CUDAExecutionProvider here"}
    result: dict[str, Any] = {}
    for name, options in CONV_VARIANTS.items():
        try:
            sess = ort.InferenceSession(str(path), providers=[("CUDAExecutionProvider",
                                                               {"device_id": str(device_id), **options})])
            result[name] = _timed(partial(sess.run, None, feeds), repeats)
        except Exception as exc:  # an option this onnxruntime does not know
            result[name] = str(exc).splitlines()[0][:200]
    return result


def probe(bundle: Path, backend: str, out: Path, frames: Sequence[int], repeats: int) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    request = SynthesisRequest(text=PROBE_TEXT, stream=False, seed=1)
    report: dict[str, Any] = {"backend": backend, "bundle": str(bundle)}
    # auto: the fixed-size (CUDA graph) decode where the bundle has it; then the dynamic step
    report["offline"] = offline_run(bundle, backend, SynthesisSettings(backend=backend), request)
    if report["offline"]["fixed_size_decode"]:
        report["offline_dynamic_decode"] = offline_run(bundle, backend,
                                                       SynthesisSettings(backend=backend, graph_decode=False), request)
    engine = load_synthesizer(bundle, backend=backend, settings=SynthesisSettings(backend=backend))
    try:
        path = engine.bundle.stages["flow_estimator"].path
        report["estimator"] = [estimator_ways(path, estimator_feeds(engine, n), repeats) for n in frames]
        hift = engine.bundle.stages["hift_decoder"].path
        report["conv_variants"] = {
            "hift_decoder_56": conv_variants(hift, vocoder_feeds(engine, 56), repeats),
            "hift_decoder_500": conv_variants(hift, vocoder_feeds(engine, 500), repeats),
            "flow_estimator_500": conv_variants(path, estimator_feeds(engine, 500), repeats),
        }
    finally:
        engine.close()
    prof_dir = out / "ort_profile"
    os.environ[PROFILE_ENV] = str(prof_dir)
    try:
        engine = load_synthesizer(bundle, backend=backend, settings=SynthesisSettings(backend=backend))
        try:
            list(engine.synthesize(request))
        finally:
            engine.close()
    finally:
        del os.environ[PROFILE_ENV]
    text = render(summarize_dir(prof_dir))
    (out / "profile.txt").write_text(text + "\n")
    (out / "probe.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cosyedge_build.tools.device_probe",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--backend", default="ort-cuda")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--frames", default="100,500,1500", help="estimator window lengths to time (mel frames)")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    report = probe(args.bundle, args.backend, args.out, [int(f) for f in args.frames.split(",")], args.repeats)
    print(json.dumps(report, indent=2))
    print((args.out / "profile.txt").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
