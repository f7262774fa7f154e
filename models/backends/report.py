"""GPU, TensorRT and engine state for `cosyedge doctor` (and bench reports).

`tensorrt_status()` and `engine_report(bundle_dir)` return plain dicts
(JSON-ready) and never raise for a missing GPU or TensorRT: they say what is
missing and how to fix it. Nothing here touches TensorRT unless a GPU is
present (cosyedge_models.backends.gpu_probe)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cosyedge_models.backends.engine_meta import engine_mismatches, engine_warnings
from cosyedge_models.backends.gpu_probe import local_identity, probe_gpu, probe_tensorrt
from cosyedge_models.bundle.memory_budget import BOARDS, PRECISIONS, bundle_budget, format_table
from cosyedge_models.errors import CosyEdgeError

ASSUMPTIONS = (
    "usable memory = MemTotal of each module; OS 1.0 GiB (headless JetPack); CUDA + TensorRT runtime 0.6 GiB; "
    "cosyedge CPU side 0.4 GiB + loaded arrays; one worker thread per stage group; 10% kept free; "
    "activations estimated until 'cosyedge build engines' records TensorRT's measured device memory"
)


def tensorrt_status(device_id: int = 0) -> dict[str, Any]:
    """{"gpu": {...}, "tensorrt": {...}, "pycuda": {...}, "usable": bool, "fix": [..]}"""
    gpu = probe_gpu()
    trt = probe_tensorrt()
    fixes = []
    status: dict[str, Any] = {
        "gpu": {"available": gpu.available, "detail": gpu.reason, "driver_version": gpu.driver_version,
                "devices": [{"index": d.index, "name": d.name, "compute_capability": d.compute_capability,
                             "multiprocessors": d.multiprocessors, "memory_bytes": d.total_memory_bytes}
                            for d in gpu.devices]},
        "tensorrt": {"available": trt.available, "version": trt.version, "detail": trt.reason},
    }
    if not gpu.available:
        fixes.append("no GPU: run on a Jetson (JetPack 6.2 or 7.0) or a machine with an NVIDIA GPU and driver; "
                     "the daemon falls back to onnxruntime on the CPU")
    elif not trt.available:
        fixes.append("install TensorRT: on Jetson 'apt-get install python3-libnvinfer' (JetPack), and create the venv "
                     "with --system-site-packages so it sees it")
    try:
        import importlib.util

        has_pycuda = importlib.util.find_spec("pycuda") is not None
    except (ImportError, ValueError):
        has_pycuda = False
    status["pycuda"] = {"available": has_pycuda}
    if not has_pycuda:
        fixes.append("install pycuda on the board: pip install pycuda==2025.1.2 (builds against JetPack's CUDA; "
                     "needs python3-dev and nvcc on PATH, e.g. export PATH=/usr/local/cuda/bin:$PATH)")
    status["usable"] = gpu.available and trt.available and has_pycuda
    status["fix"] = fixes
    if status["usable"]:
        ident = local_identity(device_id)
        status["identity"] = {"tensorrt": ident.tensorrt, "gpu": ident.gpu,
                              "compute_capability": ident.compute_capability}
    return status


def engine_report(bundle_dir: Path | str, device_id: int = 0) -> dict[str, Any]:
    """Engines of the bundle (built? for this device?) and its Jetson memory
    budget for fp32 / fp16 / int8."""
    root = Path(bundle_dir)
    report: dict[str, Any] = {"bundle": str(root)}
    try:
        manifest = json.loads((root / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        report["error"] = f"cannot read {root / 'manifest.json'}: {exc}"
        return report
    engines = manifest.get("engines")
    state: dict[str, Any] = {"built": bool(engines)}
    if engines:
        state.update({k: engines.get(k) for k in ("tensorrt", "gpu", "compute_capability", "precision", "built",
                                                     "board", "workspace_bytes")})
        state["stages"] = {
            name: {"file": e.get("file"), "exists": (root / str(e.get("file"))).exists(),
                   "plan_bytes": e.get("plan_bytes"), "device_memory_bytes": e.get("device_memory_bytes")}
            for name, e in engines.get("stages", {}).items()}
        trt = probe_tensorrt()
        if trt.available:
            try:
                local = local_identity(device_id)
            except CosyEdgeError as exc:
                state["compatible"], state["problems"] = False, [str(exc)]
            else:
                problems = engine_mismatches(engines, local)
                state["compatible"] = not problems
                state["problems"] = problems
                state["warnings"] = engine_warnings(engines, local)
        else:
            state["compatible"] = None
            state["problems"] = [f"cannot check here: {trt.reason}"]
        missing = [n for n, s in state["stages"].items() if not s["exists"]]
        if missing:
            state["compatible"] = False
            state.setdefault("problems", []).append(f"missing plan files for {', '.join(missing)}")
        if state.get("compatible") is False:
            state["fix"] = f"cosyedge build engines --bundle {root}"
    else:
        state["fix"] = f"build them on the board: cosyedge build engines --bundle {root}"
    report["engines"] = state
    try:
        budgets = [bundle_budget(root, manifest, p) for p in PRECISIONS]
    except (CosyEdgeError, KeyError, ValueError) as exc:
        report["budget_error"] = f"cannot compute the memory budget: {exc}"
        return report
    report["budget"] = {b.precision: b.as_dict() for b in budgets}
    report["budget_table"] = format_table(budgets)
    report["boards"] = {b.key: b.label for b in BOARDS.values()}
    report["assumptions"] = ASSUMPTIONS
    return report
