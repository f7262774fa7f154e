"""Jetson projection: the time each stage takes per call on a board, from
what the stage computes and moves per call (models/tools/graph_cost.py counts it
from the graphs) and the board's published peaks, as a roofline: a call
takes max(FLOPs / peak throughput, bytes / memory bandwidth). From the stage
times: the expected time to first audio (streaming) and the real-time
factor per board and precision.

It is a lower bound: it charges nothing for kernel launches, host work or
peaks a real kernel does not reach. The same model's prediction for the
H200, set beside what the H200 measured, shows how far from it a real run
is (docs/jetson-projection.md). Pure arithmetic, no I/O.

Peaks: GPU only (no DLA), dense (no structured sparsity). Sources, also in
docs/jetson-projection.md:
* AGX Orin 64 GB: NVIDIA Jetson AGX Orin Series Technical Brief v1.2: GPU
  2048 CUDA cores / 64 tensor cores at 1.3 GHz, 5.3 FP32 TFLOPS, 170 sparse
  INT8 TOPS (85 dense); 204.8 GB/s LPDDR5.
* Orin NX 16 GB and Orin Nano 8 GB: their module data sheets (1024 CUDA
  cores / 32 tensor cores; Nano 8 GB: 40 sparse = 20 dense INT8 TOPS at
  625 MHz, 68 GB/s; NX 16 GB: 918 MHz, 102.4 GB/s), at the JetPack 6.2
  "Super" (MAXN SUPER) GPU clocks of NVIDIA's Jetson Orin Nano Super
  announcement (Nano: 1020 MHz, 102 GB/s, 67 sparse TOPS; NX: 1173 MHz,
  157 sparse TOPS for the whole module). Dense INT8 per tensor core and clock
  from the AGX Orin figures (85e12 / (64 x 1.3e9) = 1021 ops), fp16 half of
  it (Ampere), fp32 2 FLOPs per CUDA core and clock.
* H200 SXM: NVIDIA H200 Tensor Core GPU product brief: 67 FP32 TFLOPS (no
  tensor cores), 989 dense FP16 TFLOPS, 1979 dense INT8 TOPS, 4.8 TB/s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TERA = 1e12
INT8_OPS_PER_TC_CLOCK = 85e12 / (64 * 1.3e9)  # AGX Orin: 85 dense INT8 TOPS, 64 tensor cores at 1.3 GHz


@dataclass(frozen=True)
class DevicePeak:
    key: str
    label: str
    fp32_tflops: float
    fp16_tflops: float
    int8_tops: float
    bandwidth_gbs: float
    source: str

    def throughput(self, precision: str) -> float:
        """Peak operations per second at `precision`."""
        table = {"fp32": self.fp32_tflops, "fp16": self.fp16_tflops, "int8": self.int8_tops}
        if precision not in table:
            raise ValueError(f"precision {precision!r}: allowed values: {', '.join(table)}")
        return table[precision] * TERA


def _orin(key: str, label: str, cuda_cores: int, tensor_cores: int, clock_ghz: float, bandwidth_gbs: float,
          source: str) -> DevicePeak:
    int8 = tensor_cores * clock_ghz * 1e9 * INT8_OPS_PER_TC_CLOCK / TERA
    return DevicePeak(key, label, 2 * cuda_cores * clock_ghz * 1e9 / TERA, int8 / 2, int8, bandwidth_gbs, source)


DEVICES: dict[str, DevicePeak] = {d.key: d for d in (
    _orin("orin-nano-8gb", "Jetson Orin Nano 8 GB (MAXN SUPER)", 1024, 32, 1.02, 102.0,
          "Orin Nano data sheet; Jetson Orin Nano Super announcement (JetPack 6.2)"),
    _orin("orin-nx-16gb", "Jetson Orin NX 16 GB (MAXN SUPER)", 1024, 32, 1.173, 102.4,
          "Orin NX data sheet; Jetson Orin Nano Super announcement (JetPack 6.2)"),
    _orin("agx-orin-64gb", "Jetson AGX Orin 64 GB (MAXN)", 2048, 64, 1.3, 204.8,
          "Jetson AGX Orin Series Technical Brief v1.2"),
    DevicePeak("h200", "NVIDIA H200 SXM", 67.0, 989.0, 1979.0, 4800.0, "H200 Tensor Core GPU product brief"),
)}
BOARDS = ("orin-nano-8gb", "orin-nx-16gb", "agx-orin-64gb")
PRECISIONS = ("fp16", "int8")
WEIGHT_BYTES = {"fp32": 4, "fp16": 2, "int8": 1}
ACT_BYTES = {"fp32": 4, "fp16": 2, "int8": 2}  # int8 graphs keep fp16 activations between Q/DQ pairs


@dataclass(frozen=True)
class StageCost:
    """What one call of a stage computes and moves, in elements (precision-free)."""

    stage: str
    flops: float
    weight_params: float  # parameters read per call (all of them: no weight fits in cache)
    activation_elems: float  # inputs, outputs and caches read or written per call

    def bytes(self, precision: str) -> float:
        return self.weight_params * WEIGHT_BYTES[precision] + self.activation_elems * ACT_BYTES[precision]


def call_seconds(cost: StageCost, device: DevicePeak, precision: str) -> float:
    """Roofline time of one call."""
    return max(cost.flops / device.throughput(precision), cost.bytes(precision) / (device.bandwidth_gbs * 1e9))


@dataclass(frozen=True)
class Workload:
    """Which stage calls make the first audio and one second of audio:
    stage -> list of (cost of one call, how many such calls)."""

    first_audio: Mapping[str, Sequence[tuple[StageCost, float]]]
    per_audio_second: Mapping[str, Sequence[tuple[StageCost, float]]]


def _stage_seconds(calls: Mapping[str, Sequence[tuple[StageCost, float]]], device: DevicePeak,
                   precision: str) -> dict[str, float]:
    return {stage: sum(n * call_seconds(c, device, precision) for c, n in items) for stage, items in calls.items()}


def project(workload: Workload, device: DevicePeak, precision: str) -> dict[str, Any]:
    """Per-stage seconds for first audio and per second of audio, the first
    audio in ms and the RTF (stages run one after another: no overlap)."""
    first = _stage_seconds(workload.first_audio, device, precision)
    per_second = _stage_seconds(workload.per_audio_second, device, precision)
    calls = {**{s: items[0][0] for s, items in workload.first_audio.items() if s == "llm_prefill"},
             **{s: items[0][0] for s, items in workload.per_audio_second.items()}}
    return {
        "device": device.key, "label": device.label, "precision": precision,
        "first_audio_ms": round(sum(first.values()) * 1e3, 2),
        "first_audio_stage_ms": {k: round(v * 1e3, 3) for k, v in first.items()},
        "rtf": round(sum(per_second.values()), 5),
        "rtf_stage": {k: round(v, 5) for k, v in per_second.items()},
        # one call mid-utterance (the prefill: the prompt), for per-call measurements
        "call_ms": {k: round(call_seconds(c, device, precision) * 1e3, 4) for k, c in calls.items()},
    }


def projection_table(workload: Workload, measured_h200: Mapping[str, float] | None = None,
                     h200_precision: str = "fp32") -> dict[str, Any]:
    """Every board x precision, and the H200 prediction beside its measurement
    (`measured_h200`: first_audio_ms, rtf, and optionally per-stage ms such
    as decode_step_ms), with the ratio measured / predicted."""
    rows = [project(workload, DEVICES[b], p) for b in BOARDS for p in PRECISIONS]
    h200 = project(workload, DEVICES["h200"], h200_precision)
    out: dict[str, Any] = {"boards": rows, "h200": {"predicted": h200}}
    if measured_h200:
        out["h200"]["measured"] = dict(measured_h200)
        ratios = {k: round(v / h200[k], 2) for k, v in measured_h200.items()
                  if k in ("first_audio_ms", "rtf") and h200[k]}
        step = h200["call_ms"].get("llm_decode")
        if "decode_step_ms" in measured_h200 and step:
            ratios["decode_step_ms"] = round(measured_h200["decode_step_ms"] / step, 2)
        out["h200"]["measured_over_predicted"] = ratios
    return out


# What the H200 measured (README "Benchmarks", 2026-11-29: fp32 ort-cuda, full-size random-weight bundle;
# no raw JSON of that run is in docs/benchmarks/): streaming first audio at concurrency 1, offline RTF on a
# 10.4 s utterance, one CUDA-graph decode step.
# What the H200 measured (docs/gpu.md), full size, fp32 `ort-cuda`: first audio with the
# cached zero-shot voice and offline RTF over a 26 s utterance from the fourth run, 2026-12-02
# (docs/benchmarks/h200-2026-12-02-run4.json); the captured decode step from
# 2026-12-01 (docs/benchmarks/h200-2026-12-01-single-stream.json).
H200_MEASURED = {"first_audio_ms": 279.0, "rtf": 0.202, "decode_step_ms": 3.4}


def format_projection(table: Mapping[str, Any]) -> str:
    lines = [f"{'device':38} {'prec':5} {'first audio ms':>14} {'RTF':>8}   stages (first audio, ms)"]
    for row in [*table["boards"], table["h200"]["predicted"]]:
        stages = ", ".join(f"{k} {v:.1f}" for k, v in row["first_audio_stage_ms"].items())
        lines.append(f"{row['label']:38} {row['precision']:5} {row['first_audio_ms']:>14.1f} {row['rtf']:>8.4f}   "
                     f"{stages}")
    measured = table["h200"].get("measured")
    if measured:
        ratio = table["h200"]["measured_over_predicted"]
        lines.append(f"{'NVIDIA H200 measured (docs/gpu.md)':38} {'fp32':5} {measured['first_audio_ms']:>14.1f} "
                     f"{measured['rtf']:>8.4f}   measured / predicted: first audio {ratio.get('first_audio_ms')}x, "
                     f"RTF {ratio.get('rtf')}x, decode step {ratio.get('decode_step_ms')}x")
    return "\n".join(lines)
