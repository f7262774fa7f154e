"""`cosyedge build validate`: an intact bundle passes, including the
comparison with the official pipeline on its source checkpoint; a changed
file is reported."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _validate(bundle: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cosyedge_daemon", "build", "validate",
                           "--bundle", str(bundle), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_intact_bundle_passes_and_matches_the_official_pipeline(tiny_bundle: Path, tiny_model_dir: Path) -> None:
    res = _validate(tiny_bundle, "--model-dir", str(tiny_model_dir))
    assert res.returncode == 0, res.stderr
    assert "bundle OK" in res.stdout and "official pipeline" in res.stdout and "same length True" in res.stdout
    assert "same tokens True" in res.stdout


def test_a_changed_file_fails_validation(tiny_bundle: Path, tmp_path: Path) -> None:
    copy = tmp_path / "b"
    shutil.copytree(tiny_bundle, copy)
    noise = copy / "flow_noise.npy"
    data = bytearray(noise.read_bytes())
    data[-1] ^= 0xFF
    noise.write_bytes(bytes(data))
    res = _validate(copy, "--model-dir", str(tmp_path / "absent"))
    assert res.returncode == 2
    assert "flow_noise.npy: sha256 differs" in res.stdout + res.stderr
