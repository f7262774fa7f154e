"""The machine a benchmark ran on, as the `machine` field of every
benchmark JSON names it: the CPU, and first the GPU when the measured
backend runs on one."""

from __future__ import annotations

import os
import platform
from pathlib import Path

GPU_BACKENDS = ("ort-cuda", "ort-trt", "trt")


def gpu_names(proc: Path = Path("/proc")) -> list[str]:
    """The NVIDIA GPUs the driver lists (desktop and datacenter cards), else a Jetson's model."""
    names = []
    for info in sorted((proc / "driver" / "nvidia" / "gpus").glob("*/information")):
        try:
            for line in info.read_text().splitlines():
                if line.startswith("Model:"):
                    names.append(line.split(":", 1)[1].strip())
        except OSError:
            continue
    if not names:
        try:  # a Jetson: its GPU is part of the module the device tree names
            model = (proc / "device-tree" / "model").read_text().strip("\x00\n ")
            if model:
                names.append(model)
        except OSError:
            pass
    return names


def machine(backend: str | None = None, proc: Path = Path("/proc")) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in (proc / "cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    host = f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}"
    if backend in GPU_BACKENDS and (gpus := gpu_names(proc)):
        return f"{' + '.join(gpus)} (host: {host})"
    return host
