"""The `machine` field: the CPU, and first the GPU when the backend runs on one
(the driver's model line, or a Jetson's device-tree model)."""

from __future__ import annotations

from pathlib import Path

from cosyedge_models.tools.host import gpu_names, machine


def _proc(tmp_path: Path, gpu: str | None = None, jetson: str | None = None) -> Path:
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nmodel name\t: Test CPU 9000\n")
    if gpu is not None:
        d = tmp_path / "driver" / "nvidia" / "gpus" / "0000:01:00.0"
        d.mkdir(parents=True)
        (d / "information").write_text(f"Model: \t\t {gpu}\nIRQ:   \t\t 42\n")
    if jetson is not None:
        (tmp_path / "device-tree").mkdir()
        (tmp_path / "device-tree" / "model").write_text(jetson + "\x00")
    return tmp_path


def test_gpu_backend_names_the_gpu_first(tmp_path: Path) -> None:
    proc = _proc(tmp_path, gpu="NVIDIA H200")
    assert machine("ort-cuda", proc).startswith("NVIDIA H200 (host: Test CPU 9000, ")
    assert machine("ort", proc).startswith("Test CPU 9000, ")  # a CPU run names the CPU only


def test_jetson_model_and_no_gpu(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    assert gpu_names(_proc(tmp_path / "a", jetson="NVIDIA Jetson Orin Nano Developer Kit")) == [
        "NVIDIA Jetson Orin Nano Developer Kit"]
    (tmp_path / "b").mkdir()
    assert machine("trt", _proc(tmp_path / "b")).startswith("Test CPU 9000, ")
