"""The board runs the daemon without torch, transformers or the build side:
importing what `cosyedge run` imports must not pull them in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import sys
import daemon.cli, daemon.service_main
daemon.cli.build_parser(), daemon.service, daemon.engines, daemon.audio_wiring
import models.engine, models.backends.ort, models.backends.trt
heavy = sorted(m for m in ("torch", "transformers", "hyperpyyaml", "onnx", "librosa", "scipy", "tensorrt",
                          "pycuda", "edge_build", "cloud_bridge.bridge", "tritonclient") if m in sys.modules)
print(",".join(heavy))
"""


def test_daemon_runtime_imports_no_heavy_packages() -> None:
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
