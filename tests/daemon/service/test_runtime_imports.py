"""The board runs the daemon without torch, transformers or the build side:
importing what `cosyedge run` imports must not pull them in (nor aiohttp,
which only a daemon with the HTTP API on imports)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

CHECK = """
import sys
import cosyedge_daemon.cli.main, cosyedge_daemon.cli.run
import cosyedge_daemon.service.service, cosyedge_daemon.synthesizers.factory, cosyedge_daemon.service.wiring
cosyedge_daemon.cli.main.build_parser()
import cosyedge_models.synthesis.synthesizer, cosyedge_models.backends.ort, cosyedge_models.backends.tensorrt.backend
heavy = sorted(m for m in ("torch", "transformers", "hyperpyyaml", "onnx", "librosa", "scipy", "tensorrt", "pycuda",
                          "cosyedge_build", "cosyedge_cloud.bridge.service", "tritonclient",
                          "aiohttp") if m in sys.modules)  # aiohttp: only with [http] listen
print(",".join(heavy))
"""


def test_daemon_runtime_imports_no_heavy_packages() -> None:
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
