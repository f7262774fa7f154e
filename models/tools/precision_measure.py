"""Measure a bundle's fp32 and fp16 variants on one backend and record which is faster
in the bundle (models/bundle/precision_speed.py: with `precision` unset, ort-cuda then
loads the faster one). Run on the device the bundle serves from, e.g. on the H200:

    python -m cosyedge_models.tools.precision_measure --bundle B16 --backend ort-cuda --write

The figures: median offline RTF and streaming first audio over `--repeats` runs of
one text, each precision loaded alone after a warm-up run, plus the mel SNR and token
agreement of fp16 against fp32 (models/tools/precision_compare.py)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cosyedge_models.bundle.precision_speed import CANDIDATES, faster, write_record
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import CosyVoiceSynthesizer, load_synthesizer
from cosyedge_models.tools.bench import DEFAULT_TEXT, median_first_audio
from cosyedge_models.tools.bench_runs import run_once
from cosyedge_models.tools.host import machine
from cosyedge_models.tools.precision_compare import accuracy


def _figures(engine: CosyVoiceSynthesizer, text: str, repeats: int) -> dict[str, Any]:
    run_once(engine, text, stream=True, seed=0)  # warm-up: every session and shape touched
    offline = [run_once(engine, text, stream=False, seed=r) for r in range(repeats)]
    streaming = [run_once(engine, text, stream=True, seed=r) for r in range(repeats)]
    return {"rtf": round(statistics.median(r["rtf"] for r in offline), 4),
            "first_audio_ms": median_first_audio(streaming), "repeats": repeats}


def measure(bundle: Path, backend: str, text: str = DEFAULT_TEXT, repeats: int = 3) -> dict[str, Any]:
    """Both precisions' figures on `backend`, and fp16's accuracy against fp32."""
    out: dict[str, Any] = {"text": text, "machine": machine(backend),
                           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    engines: dict[str, CosyVoiceSynthesizer] = {}
    try:
        for precision in CANDIDATES:
            engines[precision] = load_synthesizer(bundle, settings=SynthesisSettings(backend=backend,
                                                                                     precision=precision))
            out[precision] = _figures(engines[precision], text, repeats)
        out["fp16_accuracy"] = accuracy(engines["fp32"], engines["fp16"], text)
    finally:
        for engine in engines.values():
            engine.close()
    out["faster"] = faster(out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cosyedge_models.tools.precision_measure",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, required=True, help="a bundle with fp32 and fp16 variants")
    p.add_argument("--backend", default="ort-cuda")
    p.add_argument("--text", default=DEFAULT_TEXT)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--write", action="store_true", help="record the figures in the bundle")
    args = p.parse_args(argv)
    figures = measure(args.bundle, args.backend, args.text, args.repeats)
    if args.write:
        write_record(args.bundle, args.backend, figures)
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
