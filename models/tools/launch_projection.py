"""The Jetson projection with a per-kernel launch cost (issue 23, boards).

The roofline (models/tools/projection.py) charges a call max(FLOPs / peak,
bytes / bandwidth) and nothing per kernel; on the H200 it predicted 11.7 ms
of first audio against 279 ms measured. The captured graphs are thousands of
small kernels (the estimator's fixed-shape step 6,810 kernels in 8.8 ms, the
LLM step 3,141 in 3.8 ms, their bytes ~0.1-0.3 ms): a call costs its
roofline plus its kernels times a per-kernel time. This module prices that
term and adds it to a saved roofline projection (`bench --project --json`),
so the boards' figures follow from the H200's measured ones without a board.

Model (pure arithmetic, no I/O):
* per-kernel seconds on the H200: least squares over measured calls,
  t = sum(k (m - r)) / sum(k^2) (k kernels, m measured seconds, r the
  roofline's seconds of the same call);
* on a board: t x (H200 GPU clock / the board's GPU clock): inside a CUDA
  graph a kernel's fixed cost (launch, ramp-up, drain) is GPU cycles;
* kernels per call: measured where measured, else the graph's nodes x the
  measured kernels per node;
* concurrency c with batched replays (one replay serves all c streams): the
  kernels are launched once; the roofline part lies between 1x (weights read
  once, the bandwidth-bound case: the LLM step, per the issue's PyTorch
  figures 1.45 ms for 1 and for 16 streams) and c x the single stream's
  (compute-bound). Both ends are given; each stream's first audio is the
  whole batch's, and each stream's RTF is the batch's time per second of audio.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Calls the projection's request makes (graph_cost.bundle_workload's defaults): first audio = one
# prefill, hop 25 + lookahead 3 decode steps, one encoder call, 10 Euler steps, the vocoder's source
# and decoder once; one second of audio = 25 steps, one encoder call, 10 Euler steps, the vocoder.
FIRST_AUDIO_CALLS: dict[str, dict[str, float]] = {
    "llm_prefill": {"llm_prefill": 1}, "llm_decode": {"llm_decode": 28}, "flow_encoder": {"flow_encoder": 1},
    "flow_estimator": {"flow_estimator": 10}, "vocoder": {"hift_source": 1, "hift_decoder": 1}}
SECOND_CALLS: dict[str, dict[str, float]] = {
    "llm_decode": {"llm_decode": 25}, "flow_encoder": {"flow_encoder": 1},
    "flow_estimator": {"flow_estimator": 10}, "vocoder": {"hift_source": 1, "hift_decoder": 1}}

# Measured on the H200 (issue 23, each graph alone, captured, inputs on the device, 100 calls; fp32
# ort-cuda, full size): kernels per call and ms per call.
H200_KERNELS = {"flow_estimator": 6810, "llm_decode": 3141}
H200_CALL_MS = {"flow_estimator": 8.8, "llm_decode": 3.8}
# Nodes per call of the graphs the fixed-shape path runs (onnxruntime's profiler, H200 run 4,
# docs/benchmarks/h200-2026-12-02-run4.json `ort_profile_uncaptured`; the fixed-shape encoder: docs/gpu.md).
NODES = {"llm_prefill": 1626, "llm_decode": 1339, "flow_encoder": 584, "flow_estimator": 2787,
         "hift_source": 85, "hift_decoder": 545}
H200_CLOCK_GHZ = 1.98  # H200 SXM boost clock
# GPU clocks of the boards (docs/jetson-projection.md's sources: MAXN SUPER for Nano/NX, MAXN for AGX)
BOARD_CLOCK_GHZ = {"orin-nano-8gb": 1.02, "orin-nx-16gb": 1.173, "agx-orin-64gb": 1.3, "h200": H200_CLOCK_GHZ}


@dataclass(frozen=True)
class CallPoint:
    """One measured call: its kernels, its measured seconds, the roofline's seconds."""

    kernels: float
    measured_s: float
    roofline_s: float


def calibrate_kernel_seconds(points: Sequence[CallPoint]) -> float:
    """Seconds per kernel that best explain `points` (least squares through the origin)."""
    den = sum(p.kernels ** 2 for p in points)
    if den <= 0:
        raise ValueError("calibration needs at least one call with kernels")
    return sum(p.kernels * (p.measured_s - p.roofline_s) for p in points) / den


def kernels_per_call(nodes: Mapping[str, float], measured: Mapping[str, float]) -> dict[str, float]:
    """Kernels of each graph's call: measured where measured, else its nodes x the kernels per node
    of the measured graphs."""
    ratio = sum(measured.values()) / sum(nodes[g] for g in measured)
    return {g: float(measured.get(g, n * ratio)) for g, n in nodes.items()}


def kernel_seconds(t_h200: float, clock_ghz: float) -> float:
    """Per-kernel seconds on a GPU at `clock_ghz` (fixed cycles per kernel)."""
    return t_h200 * H200_CLOCK_GHZ / clock_ghz


def _launch(calls: Mapping[str, Mapping[str, float]], kernels: Mapping[str, float],
            seconds: Mapping[str, float]) -> dict[str, float]:
    return {stage: sum(n * kernels[g] * seconds[g] for g, n in graphs.items()) for stage, graphs in calls.items()}


def with_launch(row: Mapping[str, Any], kernels: Mapping[str, float], t: float,
                concurrency: int = 1, fused: Mapping[str, float] | None = None) -> dict[str, Any]:
    """A saved roofline row (`project`'s: first_audio_stage_ms, rtf_stage) with the launch term, at
    `concurrency` streams served by batched replays: ms and RTF as a [low, high] pair (roofline x1 or
    x concurrency) plus the launches once. `fused`: graphs whose kernels cost other seconds each
    (the fused graphs' fewer, larger kernels), by graph; the others cost `t`."""
    seconds = {g: (fused or {}).get(g, t) for g in kernels}
    first_launch = _launch(FIRST_AUDIO_CALLS, kernels, seconds)
    second_launch = _launch(SECOND_CALLS, kernels, seconds)
    roof_first = sum(row["first_audio_stage_ms"].values()) / 1e3
    roof_second = sum(row["rtf_stage"].values())
    launch_first, launch_second = sum(first_launch.values()), sum(second_launch.values())
    return {
        "device": row["device"], "precision": row["precision"], "concurrency": concurrency,
        "kernel_us": round(t * 1e6, 3),
        **({"fused_kernel_us": {g: round(v * 1e6, 3) for g, v in fused.items()}} if fused else {}),
        "launch_ms": {"first_audio": round(launch_first * 1e3, 2), "per_audio_second": round(launch_second * 1e3, 2)},
        "first_audio_ms": [round((roof_first + launch_first) * 1e3, 1),
                           round((roof_first * concurrency + launch_first) * 1e3, 1)],
        "rtf": [round(roof_second + launch_second, 4), round(roof_second * concurrency + launch_second, 4)],
        "first_audio_stage_ms": {s: round(row["first_audio_stage_ms"].get(s, 0.0) + first_launch[s] * 1e3, 2)
                                 for s in first_launch},
    }


def launch_table(saved: Mapping[str, Any], measured_h200: Mapping[str, float],
                 concurrencies: Sequence[int] = (1, 4), fused_kernels: Mapping[str, float] | None = None,
                 fused_call_ms: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The saved projection (`bench --project --json`) re-priced with the launch term, calibrated on
    the H200's measured calls against the saved H200 roofline; the H200's prediction beside
    `measured_h200` (first_audio_ms, rtf) and each board at each concurrency. With `fused_kernels` and
    `fused_call_ms` (the fused graphs ort-cuda serves: their kernels and ms a call), those graphs take
    their measured kernels and a per-kernel time calibrated on their calls alone; the others (the
    prefill, the encoder, the vocoder: plain graphs) keep the plain calibration."""
    h200 = saved["h200"]["predicted"]
    points = [CallPoint(H200_KERNELS[g], H200_CALL_MS[g] / 1e3, h200["call_ms"][g] / 1e3) for g in H200_KERNELS]
    t_h200 = calibrate_kernel_seconds(points)
    kernels = kernels_per_call(NODES, H200_KERNELS)
    if (fused_kernels is None) != (fused_call_ms is None):
        raise ValueError("fused_kernels and fused_call_ms go together (the fused graphs' kernels and ms a call)")
    fused_points = [CallPoint(k, fused_call_ms[g] / 1e3, h200["call_ms"][g] / 1e3)
                    for g, k in fused_kernels.items()] if fused_kernels and fused_call_ms else []
    t_fused = calibrate_kernel_seconds(fused_points) if fused_points else None
    kernels.update({g: float(k) for g, k in (fused_kernels or {}).items()})

    def fused_at(clock_ghz: float) -> dict[str, float] | None:
        return None if t_fused is None else {g: kernel_seconds(t_fused, clock_ghz) for g in fused_kernels or {}}

    predicted = with_launch(h200, kernels, t_h200, fused=fused_at(H200_CLOCK_GHZ))
    error = {k: round(predicted[k][0] / measured_h200[k] - 1, 3) for k in ("first_audio_ms", "rtf")}
    boards = [with_launch(row, kernels, kernel_seconds(t_h200, BOARD_CLOCK_GHZ[row["device"]]), c,
                          fused=fused_at(BOARD_CLOCK_GHZ[row["device"]]))
              for row in saved["boards"] for c in concurrencies]
    fused = {"fused_kernel_seconds_h200": t_fused, "fused_calibration": [vars(p) for p in fused_points]} \
        if t_fused is not None else {}
    return {"kernel_seconds_h200": t_h200, **fused, "kernels_per_call": kernels,
            "calibration": [vars(p) for p in points],
            "h200": {"predicted": predicted, "measured": dict(measured_h200), "predicted_over_measured_minus_1": error},
            "boards": boards}


# What the H200 measured (docs/gpu.md, 2026-12-02 fourth run, fp32 ort-cuda, cached zero-shot voice;
# docs/benchmarks/h200-2026-12-02-run4.json): first audio at concurrency 1, offline RTF.
H200_MEASURED = {"first_audio_ms": 279.0, "rtf": 0.202}

# The fused graphs ort-cuda serves since issue 23 (H200, fifteenth run, docs/benchmarks/h200-2026-12-04-run15.json
# `lane_replay`: each alone, captured, one stream): the fp16 batched estimator window with the fused operators
# (window 64, 400 cached frames) and the fp16 fused LLM step (batch 1, cache 320). Their kernels are fewer and
# larger than the plain graphs': they get their own per-kernel time.
H200_FUSED_KERNELS = {"flow_estimator": 1492, "llm_decode": 394}
H200_FUSED_CALL_MS = {"flow_estimator": 5.318, "llm_decode": 1.357}
# What the same run's bench measured on them (one stream, the goals' bench): single-stream first audio and
# streaming RTF (the projection prices streaming; the run's offline RTF of the same 4 s text: 0.156)
H200_FUSED_MEASURED = {"first_audio_ms": 150.4, "rtf": 0.135}


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cosyedge_models.tools.launch_projection SAVED.json [OUT.json]`: re-price a saved
    `bench --project --json` report with the launch term."""
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="launch_projection", description=main.__doc__)
    parser.add_argument("saved", type=Path)
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--fused", action="store_true",
                        help="the fused graphs ort-cuda serves (issue 23), calibrated on their own calls")
    args = parser.parse_args(argv)
    saved = json.loads(args.saved.read_text())
    body = (launch_table(saved, H200_FUSED_MEASURED, fused_kernels=H200_FUSED_KERNELS, fused_call_ms=H200_FUSED_CALL_MS)
            if args.fused else launch_table(saved, H200_MEASURED))
    table = {"bench": "jetson_projection_launch" + ("_fused" if args.fused else ""), "from": args.saved.name, **body}
    text = json.dumps(table, indent=2) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
