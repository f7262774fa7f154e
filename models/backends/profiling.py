"""The switch for onnxruntime's own per-stage trace: with COSYEDGE_ORT_PROFILE=DIR
every session writes its trace there (`python -m cosyedge_models.tools.ort_profile
DIR` summarizes them)."""

from __future__ import annotations

import os
from pathlib import Path

PROFILE_ENV = "COSYEDGE_ORT_PROFILE"


def profile_dir() -> Path | None:
    """The directory the sessions profile into (COSYEDGE_ORT_PROFILE), or None: no profiling."""
    value = os.environ.get(PROFILE_ENV, "").strip()
    return Path(value) if value else None
