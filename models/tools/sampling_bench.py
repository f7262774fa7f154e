"""The host time of sampling one batched LLM step: each row alone (`TokenSampler.sample`, how the
batchers sampled until issue 23's host-work lever) against the rows together
(`sampling.sample_rows`), at the speech vocabulary's size, for several batch sizes:

    python -m cosyedge_models.tools.sampling_bench --json F.json [--rows 1,8,16] [--steps 200] [--runs 5]

Logits are seeded Gaussian draws at two sharpnesses (a flat and a peaked step); each row has its own
seeded sampler and a history of decoded tokens, so repetition-aware redraws happen as in speech.
Both ways draw the same tokens (tests/models/synthesis/test_sampling.py); this only times them.
Prints and writes the median over `--runs` of the mean microseconds per step."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from cosyedge_models.bundle.loader import SamplingConfig
from cosyedge_models.synthesis.sampling import TokenSampler, sample_rows, softmax_rows
from cosyedge_models.tools.host import machine

VOCAB = 6564  # CosyVoice 2's speech tokens, EOS and fill tokens included
EOS = 6561
SHARPNESS = {"flat": 1.0, "peaked": 6.0}


def _steps(rows: int, steps: int, scale: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((steps, rows, VOCAB)) * scale).astype(np.float32)
    return np.log(softmax_rows(logits.reshape(-1, VOCAB)) + np.float32(1e-30)).reshape(steps, rows, VOCAB)


def time_sampling(rows: int, steps: int, scale: float, together: bool, seed: int = 0) -> float:
    """Mean microseconds per step of `steps` steps of `rows` rows."""
    logps = _steps(rows, steps, scale, seed)
    config = SamplingConfig()
    samplers = [TokenSampler.seeded(config, EOS, seed + r) for r in range(rows)]
    decoded: list[list[int]] = [[] for _ in range(rows)]
    ignore = [False] * rows
    t0 = time.perf_counter()
    for logp in logps:
        if together:
            tokens = sample_rows(samplers, logp, decoded, ignore)
        else:
            tokens = [s.sample(lp, d, False) for s, lp, d in zip(samplers, logp, decoded, strict=True)]
        for d, t in zip(decoded, tokens, strict=True):
            if isinstance(t, int):
                d.append(t)
    return (time.perf_counter() - t0) / steps * 1e6


def run(rows: Sequence[int], steps: int, runs: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, scale in SHARPNESS.items():
        for b in rows:
            alone = [time_sampling(b, steps, scale, False, seed) for seed in range(runs)]
            together = [time_sampling(b, steps, scale, True, seed) for seed in range(runs)]
            results[f"{name}_b{b}"] = {
                "rows": b, "row_by_row_us_per_step": round(statistics.median(alone), 1),
                "together_us_per_step": round(statistics.median(together), 1),
                "row_by_row_runs_us": [round(x, 1) for x in alone], "together_runs_us": [round(x, 1) for x in together],
            }
    return {"what": "host time of sampling one batched LLM step (models/tools/sampling_bench.py)",
            "machine": machine(), "vocab": VOCAB, "steps": steps, "runs": runs, "results": results}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if args.steps < 1 or args.runs < 1 or any(r < 1 for r in rows):
        ap.error("--rows, --steps and --runs must be >= 1")
    out = run(rows, args.steps, args.runs)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
