"""The machine a benchmark ran on, as the `machine` field of every
benchmark JSON names it (the CPU; the GPU is in the backend's description)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}"
