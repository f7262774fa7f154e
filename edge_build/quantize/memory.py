"""Memory of `cosyedge build quantize`: an estimate of its peak from the
bundle's graph sizes, checked against the memory this host has free before
any work starts, and the peak RSS it reached.

The phases (one at a time; each frees its sessions before the next):
* capture: the fp32 engine synthesizes the calibration and held-out texts
  (every stage session loaded; onnxruntime maps the weights and prepacks the
  MatMul ones: ~2x the graphs; plus its activations over long utterances,
  ENGINE_ACTIVATION_FACTOR; feeds go to disk, not memory);
* one graph at a time: onnxruntime's quantizer holds the shape-inferred
  model, the calibration session over its augmented copy and the quantized
  model (~4x the graph; calibration folds its tensors into running ranges
  after every run instead of holding them all), plus the calibration run's
  activations (ACTIVATION_FACTOR: the flow estimator's dominate);
* the accuracy report: the fp32 and the new engine side by side.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosyedge_models.errors import CosyEdgeError

GIB = 1 << 30
BASE_BYTES = int(0.6 * GIB)  # Python, numpy, onnx, onnxruntime, the tokenizer
ENGINE_FACTOR = 2.0  # mapped weights + prepacked copies per session
GRAPH_FACTOR = 4.0  # model + shape-inferred copy + calibration session + quantized model
PRECISION_RATIO = {"int8": 0.3, "int8w": 0.3, "fp16": 0.5}
# The calibration session's activations, as a multiple of the graph's size: onnxruntime's
# calibration graph keeps every calibrated tensor of a run alive until the reductions it
# appends at the end of the graph run. Measured at full size (2026-12-01): the flow
# estimator (285 MB; offline feeds cut to 300 frames by the capture, streaming windows over
# up to 1,380 cached frames) peaked at 5.84 GiB = BASE + 4x + ~14.4x its graph. The LLM's
# activations are small next to its weights (within GRAPH_FACTOR).
ACTIVATION_FACTOR = {"flow_estimator": 15.0}
# The fp32 engine's own activations while it synthesizes (capture, accuracy report), as a multiple
# of the graph: random-weight checkpoints speak to the LLM's maximum length, and the offline flow
# over a whole 20-30 s utterance (full attention in 56 blocks) dominates. Measured at full size
# (2026-12-01): the capture of the default calibration peaked at ~10.2 GB RSS where the weights
# alone account for 2.95 GiB (+7.3 GB: ~26x the estimator's 285 MB); one 31.2 s offline
# utterance alone took the engine to 5.7 GiB.
ENGINE_ACTIVATION_FACTOR = {"flow_estimator": 26.0}
ENGINE_STAGES = ("llm_prefill", "llm_decode", "flow_encoder", "flow_estimator", "hift_source", "hift_decoder")


class QuantizeMemoryError(CosyEdgeError):
    """The run would not fit in this host's free memory; nothing was started."""


@dataclass(frozen=True)
class MemoryEstimate:
    phases: dict[str, int]  # phase -> bytes at its peak, BASE_BYTES included

    @property
    def peak_bytes(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k])

    def as_dict(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak_bytes, "peak_phase": self.peak_phase, "phases": dict(self.phases)}


def graph_bytes(path: Path) -> int:
    """An ONNX file plus its external data (`<file>.data`, or a shared weights file it names)."""
    if not path.exists():
        return 0
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)


def estimate_peak(stage_bytes: dict[str, int], quantized: list[str], precision: str,
                  shared_llm_bytes: int = 0) -> MemoryEstimate:
    """Pure arithmetic: `stage_bytes` the fp32 graph sizes per stage,
    `quantized` the stages rewritten, `shared_llm_bytes` the LLM weights when
    the bundle keeps one copy for prefill and decode (then counted once and
    not prepacked)."""
    engine = 0.0
    for stage in ENGINE_STAGES:
        size = stage_bytes.get(stage, 0)
        if shared_llm_bytes and stage.startswith("llm_"):
            size = max(size - shared_llm_bytes, 0)
        engine += size * ENGINE_FACTOR
    engine += shared_llm_bytes
    engine += sum(stage_bytes.get(s, 0) * f for s, f in ENGINE_ACTIVATION_FACTOR.items())
    per_graph = max((stage_bytes.get(s, 0) * (GRAPH_FACTOR + ACTIVATION_FACTOR.get(s, 0.0)) for s in quantized),
                    default=0)
    ratio = PRECISION_RATIO.get(precision, 1.0)
    phases = {
        "capture": int(engine) + BASE_BYTES,
        "quantize_graph": int(per_graph) + BASE_BYTES,
        "accuracy_report": int(engine * (1 + ratio)) + BASE_BYTES,
    }
    return MemoryEstimate(phases)


def available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable (what can be allocated without swapping), None where unknown."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_fits(estimate: MemoryEstimate, available: int | None, limit: int | None = None) -> None:
    """Raise before the run starts when its estimated peak exceeds the free
    memory (or the `limit` the user set)."""
    bound = min(b for b in (available, limit) if b is not None) if (available or limit) else None
    if bound is None or estimate.peak_bytes <= bound:
        return
    what = "the --max-memory-gb limit" if limit is not None and bound == limit else "this host's available memory"
    raise QuantizeMemoryError(
        f"quantization would need about {estimate.peak_bytes / GIB:.1f} GiB at its peak "
        f"({estimate.peak_phase}), more than {what} ({bound / GIB:.1f} GiB); phases: "
        + ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in estimate.phases.items())
        + ". Free memory (stop other jobs) or build on a larger host; nothing was started")


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
