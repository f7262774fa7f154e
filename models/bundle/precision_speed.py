"""fp16 by default on CUDA where it is faster: a bundle that holds both an fp32 and an
fp16 variant of its stages (`python -m cosyedge_build.tools.device_fp16`, `cosyedge
build quantize --precision fp16`) may record, per backend, the measured speed of
each (PRECISION_SPEED_FILE, written by `python -m cosyedge_models.tools.precision_speed`
on the device). With `SynthesisSettings.precision` unset, a CUDA backend then loads
the precision that measured faster; without a record (or on the CPU) the bundle's
own precision, as before. An explicit precision always wins. Pure logic and the
file's reading and writing; no measuring here."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PRECISION_SPEED_FILE = "precision_speed.json"
# Backends where the record decides (TensorRT plans are built for one precision).
AUTO_BACKENDS = ("ort-cuda",)
CANDIDATES = ("fp32", "fp16")


def faster(figures: Mapping[str, Mapping[str, Any]]) -> str:
    """The precision to run from one backend's figures ({"fp32": {"rtf", "first_audio_ms"},
    "fp16": {...}}): fp16 when its offline RTF is lower and its first audio no later
    (both what a user waits for); otherwise fp32."""
    a, b = figures.get("fp32", {}), figures.get("fp16", {})
    if not isinstance(a.get("rtf"), (int, float)) or not isinstance(b.get("rtf"), (int, float)):
        return "fp32"
    first_a, first_b = a.get("first_audio_ms"), b.get("first_audio_ms")
    later = isinstance(first_a, (int, float)) and isinstance(first_b, (int, float)) and first_b > first_a
    return "fp16" if b["rtf"] < a["rtf"] and not later else "fp32"


def read_record(root: Path) -> dict[str, Any]:
    """The bundle's record ({} when it has none or it is unreadable: the rule then keeps
    the bundle's own precision)."""
    path = root / PRECISION_SPEED_FILE
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("%s: not read (%s); using the bundle's own precision", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def has_precision(manifest: Mapping[str, Any], precision: str) -> bool:
    """Whether every stage can be loaded in `precision` (the bundle's own, or a variant)."""
    if manifest.get("precision", "fp32") == precision:
        return True
    stages = manifest.get("stages", {})
    return bool(stages) and all(e.get("precision", "fp32") == precision or precision in e.get("variants", {})
                                for e in stages.values() if isinstance(e, dict) and "file" in e)


def auto_precision(root: Path | str, backend: str, manifest: Mapping[str, Any]) -> str | None:
    """What an unset `precision` loads on `backend`: the faster of fp32 and fp16 where the
    bundle records both for this backend and holds both, else None (the bundle's own)."""
    if backend not in AUTO_BACKENDS:
        return None
    figures = read_record(Path(root)).get("backends", {}).get(backend)
    if not isinstance(figures, dict) or not all(has_precision(manifest, p) for p in CANDIDATES):
        return None
    choice = faster(figures)
    log.info("precision %s on %s: measured faster (%s)", choice, backend, Path(root) / PRECISION_SPEED_FILE)
    return choice


def write_record(root: Path, backend: str, figures: Mapping[str, Any]) -> dict[str, Any]:
    """Store one backend's figures (and the choice they make) in the bundle's record,
    keeping the other backends'."""
    record = read_record(root)
    record.setdefault("backends", {})[backend] = {**figures, "faster": faster(figures)}
    (root / PRECISION_SPEED_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record
