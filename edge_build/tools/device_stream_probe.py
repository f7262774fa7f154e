"""Where a streaming request's time goes on a GPU, per chunk and per session
call (the device tool's leases are short, so one call measures it all):

* every vocoder session call inside streaming runs (hift_source and
  hift_decoder separately: mel frames, ms, whether that session saw the shape
  before), with the stages overlapped and serial, and the same shapes run
  alone on fresh sessions, first call and repeat: an in-pipeline call much
  slower than the same call alone, at a shape seen before, is contention; a
  first call at a new shape much slower than its repeat is per-shape set-up
  (cuDNN algorithm choice, arena growth);
* the streaming flow with the fixed-shape estimator graphs (CUDA graphs) on
  and off: first audio, flow ms per chunk;
* with --first-audio (or --only-first-audio), "the first chunk first" on and
  off (SynthesisSettings.first_audio_first): one stream and --streams at once, each stream's first audio, its first
  chunk's stage times (the "hold" row: its first-audio hold on the graph
  thread) and what the graph thread's order did (runs per class, LLM steps
  held, holds, ms held).

    python -m cosyedge_build.tools.device_stream_probe --bundle B --backend ort-cuda --out DIR

Writes DIR/stream_probe.json."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from cosyedge_models.backends.base import Session
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer, load_synthesizer
from cosyedge_models.synthesis.vocoder import HiftVocoder
from cosyedge_models.tools.bench_runs import bench_request

log = logging.getLogger(__name__)

TEXT = "The quick brown fox jumps over the lazy dog while the robot reads the news aloud."


class TimedSession:
    """A session proxy that records (stage, frames, ms, new shape, thread) per call."""

    def __init__(self, inner: Session, calls: list[dict[str, Any]]) -> None:
        self._inner = inner
        self._calls = calls
        self._seen: set[tuple[int, ...]] = set()
        self.name = inner.name
        self.input_names = inner.input_names
        self.output_names = inner.output_names

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        shape = tuple(inputs["mel"].shape)
        t0 = time.perf_counter()
        out = self._inner.run(inputs, outputs)
        ms = (time.perf_counter() - t0) * 1e3
        self._calls.append({"stage": self.name, "frames": shape[2], "ms": round(ms, 2),
                            "new_shape": shape not in self._seen, "thread": threading.get_ident()})
        self._seen.add(shape)
        return out

    def memory_bytes(self) -> int:
        return self._inner.memory_bytes()

    def close(self) -> None:
        self._inner.close()


def _stream(engine: CosyVoiceSynthesizer, seed: int, text: str = TEXT, voice: str | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    chunks = list(engine.synthesize(bench_request(text, stream=True, seed=seed, voice=voice)))
    wall = time.perf_counter() - t0
    times = chunks[-1].times
    events: list[dict[str, Any]] = [e.as_dict() for e in sorted(times.timeline, key=lambda e: e.start_ms)]
    per_chunk: dict[int, dict[str, float]] = {}
    for e in events:
        d = per_chunk.setdefault(int(e["chunk"]), {})
        d[e["stage"]] = round(d.get(e["stage"], 0.0) + e["end_ms"] - e["start_ms"], 2)
    audio_s = sum(c.pcm.size for c in chunks) / engine.sample_rate
    return {"first_audio_ms": round(times.first_audio_ms or 0.0, 1), "wall_s": round(wall, 3),
            "audio_s": round(audio_s, 2), "rtf": round(wall / max(audio_s, 1e-9), 4),
            "flow_ms": round(times.flow_ms, 1), "vocoder_ms": round(times.vocoder_ms, 1),
            "llm_ms": round(times.llm_ms, 1), "per_chunk": per_chunk}


def vocoder_in_pipeline(bundle: Path, settings: SynthesisSettings, runs: int) -> dict[str, Any]:
    """Streaming runs with every vocoder session call timed; then the same shapes alone."""
    report: dict[str, Any] = {}
    for label, overlap in (("overlap", True), ("serial", False)):
        engine = load_synthesizer(bundle, settings=dataclasses.replace(settings, overlap_stages=overlap))
        calls: list[dict[str, Any]] = []
        try:
            v = engine.vocoder
            # a probe: the engine's vocoder rebuilt over timed proxies of its own sessions
            engine.vocoder = HiftVocoder(engine.bundle, TimedSession(v.source_session, calls),
                                         TimedSession(v.decoder_session, calls))
            streams = []
            for r in range(runs):
                mark = len(calls)
                streams.append({**_stream(engine, seed=r), "calls": calls[mark:]})
            report[label] = streams
        finally:
            engine.close()
    # the shapes seen, each on fresh sessions: first call, then the median of repeats
    shapes = sorted({(c["stage"], c["frames"]) for s in report["overlap"] for c in s["calls"]})
    engine = load_synthesizer(bundle, settings=dataclasses.replace(settings, overlap_stages=False))
    try:
        rng = np.random.default_rng(0)
        alone: list[dict[str, Any]] = []
        sessions = {"hift_source": engine.vocoder.source_session, "hift_decoder": engine.vocoder.decoder_session}
        up, harm = engine.vocoder.upsample, engine.vocoder.harmonics
        for stage, frames in shapes:
            mel = rng.standard_normal((1, engine.bundle.mel_bins, frames)).astype(np.float32)
            feeds = {"mel": mel, "noise": rng.standard_normal((1, frames * up, harm)).astype(np.float32)} \
                if stage == "hift_source" else \
                {"mel": mel, "source": (0.1 * rng.standard_normal((1, 1, frames * up))).astype(np.float32)}
            times = []
            for _ in range(6):
                t0 = time.perf_counter()
                sessions[stage].run(feeds)
                times.append((time.perf_counter() - t0) * 1e3)
            alone.append({"stage": stage, "frames": frames, "first_ms": round(times[0], 2),
                          "repeat_ms": round(statistics.median(times[1:]), 2)})
        report["alone"] = alone
    finally:
        engine.close()
    return report


def static_flow_on_off(bundle: Path, settings: SynthesisSettings, runs: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, on in (("graph_flow_on", True), ("graph_flow_off", False)):
        try:
            engine = load_synthesizer(bundle, settings=dataclasses.replace(settings, graph_flow=on))
        except Exception as exc:  # a bundle without the fixed-shape graphs
            out[label] = {"error": str(exc)[:300]}
            continue
        try:
            _stream(engine, seed=100)  # warm-up: captures
            out[label] = [_stream(engine, seed=r) for r in range(runs)]
            if engine.static_flow is not None:
                out[label + "_replays"] = engine.static_flow.replays
        except Exception as exc:  # capture refused: say why
            out[label] = {"error": str(exc)[:600]}
        finally:
            engine.close()
    return out


def _streams_at_once(engine: CosyVoiceSynthesizer, n: int, seed: int, text: str,
                     voice: str | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{} for _ in range(n)]
    start = threading.Barrier(n)

    def one(i: int) -> None:
        start.wait()
        out[i] = _stream(engine, seed=seed + i, text=text, voice=voice)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def first_audio_first_on_off(bundle: Path, settings: SynthesisSettings, runs: int, streams: int,
                             text: str = TEXT, voice: str | None = None) -> dict[str, Any]:
    """One stream, then `streams` at once, with the first-audio holds on and off (`voice`: a
    saved voice, in zero_shot mode, as bench's --voice)."""
    out: dict[str, Any] = {}
    for label, on in (("first_audio_first_on", True), ("first_audio_first_off", False)):
        # a fixed-shape flow slot and a fixed-size LLM slot for every stream: all on the graph thread
        engine = load_synthesizer(bundle, settings=dataclasses.replace(
            settings, first_audio_first=on, graph_flow_slots=max(settings.graph_flow_slots, streams),
            graph_decode_slots=max(settings.graph_decode_slots, streams)))
        try:
            if voice is not None:
                engine.warm_voice(bench_request(text, stream=True, seed=0, voice=voice))
            _stream(engine, seed=100, text=text, voice=voice)  # warm-up
            before = engine.graphs.order_stats()
            alone = [_stream(engine, seed=r, text=text, voice=voice) for r in range(runs)]
            after_alone = engine.graphs.order_stats()
            together = _streams_at_once(engine, streams, seed=200, text=text, voice=voice)
            first = sorted(r["first_audio_ms"] for r in together)
            out[label] = {"alone": alone, "concurrent": together,
                          "concurrent_first_audio_ms": {"p50": first[len(first) // 2], "max": first[-1]},
                          "graph_order": {"warm_up": before, "after_alone": after_alone,
                                          "after_concurrent": engine.graphs.order_stats()}}
        except Exception as exc:  # a bundle without the graphs, a capture refused: say why
            out[label] = {"error": str(exc)[:600]}
        finally:
            engine.close()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cosyedge_build.tools.device_stream_probe",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--backend", default="ort-cuda")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--first-audio", action="store_true",
                   help="also the first-audio-first part (two more engines: on a GPU, their captures at load)")
    p.add_argument("--only-first-audio", action="store_true", help="run only the first-audio-first part")
    p.add_argument("--streams", type=int, default=8, help="concurrent streams for the first-audio-first part")
    p.add_argument("--voice", default=None, help="a saved voice for the first-audio-first part (zero_shot)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = SynthesisSettings(backend=args.backend)
    report: dict[str, Any] = {"backend": args.backend, "bundle": str(args.bundle)}
    if args.first_audio or args.only_first_audio:
        report["first_audio_first"] = first_audio_first_on_off(args.bundle, settings, args.runs, args.streams,
                                                               voice=args.voice)
    if not args.only_first_audio:
        report["static_flow"] = static_flow_on_off(args.bundle, settings, args.runs)
        report["vocoder"] = vocoder_in_pipeline(args.bundle, dataclasses.replace(settings, graph_flow=False),
                                                args.runs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stream_probe.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(summary(report), indent=1))
    return 0


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The short table the device call's output ends with."""
    s: dict[str, Any] = {}
    for label, part in report.get("first_audio_first", {}).items():
        if "error" in part:
            s[label] = part
            continue
        s[label] = {"alone_first_audio_ms": [r["first_audio_ms"] for r in part["alone"]],
                    "alone_chunk0": part["alone"][-1]["per_chunk"].get(0),
                    "concurrent_first_audio_ms": part["concurrent_first_audio_ms"],
                    "graph_order": part["graph_order"]["after_concurrent"]}
    if "static_flow" not in report:
        return s
    for label, runs in report["static_flow"].items():
        if isinstance(runs, list):
            s[label] = [{k: r[k] for k in ("first_audio_ms", "rtf", "flow_ms", "vocoder_ms", "llm_ms")} for r in runs]
        else:
            s[label] = runs
    for label in ("overlap", "serial"):
        s["vocoder_" + label] = [[(c["stage"][5:8], c["frames"], c["ms"], int(c["new_shape"])) for c in r["calls"]]
                                 for r in report["vocoder"][label]]
    s["vocoder_alone"] = [(a["stage"][5:8], a["frames"], a["first_ms"], a["repeat_ms"])
                          for a in report["vocoder"]["alone"]]
    return s


if __name__ == "__main__":
    raise SystemExit(main())
