"""`cosyedge model pull` against the fake hub (tests/support/fake_hub.py)
serving the tiny checkpoint: end to end in its own process (HF_ENDPOINT
honoured) to a bundle that synthesizes; a pull that fails in a stage and runs
again (no second download, no second export); the installed bundle kept
while a pull fails; no network; --set-default."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import soundfile
from cosyedge_daemon.cli.bundles import install_bundle, list_bundles
from cosyedge_daemon.cli.main import main
from cosyedge_daemon.settings.loader import load_settings

from tests.support.broker import free_port
from tests.support.fake_hub import TINY_EXTRA, TINY_REPO, FakeHub, tiny_hub
from tests.support.trt_emulator import emulated_tensorrt, real_tensorrt_present

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def hub(tiny_model_dir: Path) -> Iterator[FakeHub]:
    with tiny_hub(tiny_model_dir) as h:
        yield h


def test_pull_end_to_end_then_synthesize(hub: FakeHub, tmp_path: Path) -> None:
    root, cfg = tmp_path / "bundles", tmp_path / "cosyedge.toml"
    cfg.write_text('# mine\n[tts]\n# the engine\nengine = "cosyvoice"\n[audio]\ndevice = "none"\n')
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1"}
    proc = subprocess.run([sys.executable, "-m", "cosyedge_daemon", "model", "pull", TINY_REPO, "--precision",
                           "fp32", "--bundles-dir", str(root), "--config", str(cfg), "--set-default"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    installed = root / "cosyvoice2-tiny-fp32"
    assert f"installed {installed}" in proc.stdout
    # one log line per file (no terminal: no progress bars), each checked against the hub's hash
    repo = hub.repos[TINY_REPO]
    needed = [p for p in repo.files if p not in TINY_EXTRA]
    for path in needed:
        line = next(x for x in proc.stderr.splitlines() if f"/{len(needed)} {path}: " in x)
        assert line.endswith("sha256 checked" if repo.is_lfs(path) else "git blob id checked"), line
    settings = load_settings(cfg)
    assert settings.tts.bundle == str(installed) and settings.tts.backend == "ort"
    assert cfg.read_text().startswith('# mine\n[tts]\nbundle = "')  # the rest of the file kept
    assert "# the engine" in cfg.read_text()
    assert [p.name for p in root.iterdir()] == ["cosyvoice2-tiny-fp32"]  # the work folder is gone
    record = json.loads((installed / "pull.json").read_text())
    assert record["commit"] == hub.repos[TINY_REPO].commit and record["source"] == "huggingface"
    out = tmp_path / "hello.wav"
    assert main(["synth", "Hello there.", "--bundle", str(installed), "--out", str(out)]) == 0
    pcm, rate = soundfile.read(out)
    assert rate == 24000 and pcm.size > rate // 4 and float(abs(pcm).max()) > 0.0


def test_failed_stage_then_resumed_keeps_the_installed_bundle(hub: FakeHub, tiny_bundle: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The tiny model's random weights miss the quantization's accuracy budget:
    the pull stops after its export with the reason, the bundle of that name
    stays as it was; the next pull (fp32) asks the hub nothing, reuses the
    export and, TensorRT being there (the project's emulator), builds the
    engines and names the trt backend."""
    root = tmp_path / "bundles"
    root.mkdir()
    old = install_bundle(root, "cosyvoice2-tiny-int8w", shutil.copytree(tiny_bundle, root / ".old"),
                         {"commit": "old"})
    args = ["model", "pull", TINY_REPO, "--bundles-dir", str(root), "--endpoint", hub.url]
    assert main([*args, "--precision", "int8w"]) == 2
    err = capsys.readouterr().err
    assert "the int8w bundle misses the accuracy budget" in err and "pull --precision fp32" in err
    assert [(b.name, b.source) for b in list_bundles(root)] == [(old.name, {"commit": "old"})]
    work = root / ".pull-cosyvoice2-tiny-work"
    exported = (work / "fp32" / "flow_estimator.onnx").stat()  # (the engines rewrite the manifest)
    before = len(hub.requests)
    # TensorRT from here on: the real one where it is installed, else the project's emulator (not during
    # the export: transformers probes for a real tensorrt)
    real = real_tensorrt_present()
    with contextlib.nullcontext() if real else emulated_tensorrt() as emu:
        assert main([*args, "--precision", "int8w", "--engines"]) == 2
        assert "int8w (weight-only) is an onnxruntime format" in capsys.readouterr().err
        assert main([*args, "--precision", "fp32"]) == 0
        assert emu is None or not emu.faults(), emu.faults()
    assert 'backend = "trt"' in capsys.readouterr().out
    assert hub.requests[before:] == [], "the second run asked the hub again"
    graph = (root / "cosyvoice2-tiny-fp32" / "flow_estimator.onnx").stat()
    assert (graph.st_ino, graph.st_mtime_ns) == (exported.st_ino, exported.st_mtime_ns), "the export ran again"
    installed = root / "cosyvoice2-tiny-fp32" / "manifest.json"
    assert not work.exists()
    assert {b.name: b.source.get("commit") for b in list_bundles(root)} == {
        old.name: "old", "cosyvoice2-tiny-fp32": hub.repos[TINY_REPO].commit}
    pulled = next(b for b in list_bundles(root) if b.name == "cosyvoice2-tiny-fp32")
    assert pulled.engines and pulled.source["engines"] is True
    assert real or json.loads(installed.read_text())["engines"]["tensorrt"].startswith("10.13.")


def test_failing_pull_keeps_bundle_and_says_why(hub: FakeHub, tiny_bundle: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "bundles"
    root.mkdir()
    install_bundle(root, "cosyvoice2-tiny-fp32", shutil.copytree(tiny_bundle, root / ".old"), {"commit": "old"})
    hub.faults.corrupt = {"llm.pt"}
    args = ["model", "pull", TINY_REPO, "--precision", "fp32", "--bundles-dir", str(root), "--endpoint", hub.url]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "llm.pt: sha256" in err and "does not match the hub's" in err
    assert [(b.name, b.source) for b in list_bundles(root)] == [("cosyvoice2-tiny-fp32", {"commit": "old"})]
    dead = f"http://127.0.0.1:{free_port()}"
    assert main([*args[:-1], dead]) == 2
    err = capsys.readouterr().err
    assert dead in err and "cosyedge build export --model-dir" in err and "docs/models.md" in err
    assert main([*args, "--set-default"]) == 2
    assert "--set-default writes the config file given with --config" in capsys.readouterr().err
    assert main([*args, "--source", "modelscope"]) == 2  # the same checks on ModelScope's API
    assert "llm.pt: sha256" in capsys.readouterr().err
    assert [(b.name, b.source) for b in list_bundles(root)] == [("cosyvoice2-tiny-fp32", {"commit": "old"})]
    (tmp_path / "a-file").write_text("")  # unwritable for root too
    assert main([*args[:5], "--bundles-dir", str(tmp_path / "a-file" / "b"), *args[7:]]) == 2
    assert "cannot write to the bundles folder" in capsys.readouterr().err
