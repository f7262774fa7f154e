"""Will `model pull` fit this host? Disk and memory needs estimated from the
checkpoint's file sizes before anything starts (pure arithmetic here; the
caller reads the free space and MemAvailable).

Sizes at full scale (docs/memory.md, docs/models.md): the checkpoint's
weights (llm.pt, flow.pt, hift.pt, the Qwen2 safetensors) are ~3.5 GB; the
fp32 bundle is about the size of llm.pt + flow.pt + hift.pt + the carried
ONNX models; a quantized bundle hard-links the fp32 files and adds its
variants (<= 0.5x); TensorRT plans are about the variant's size. The export
holds the torch modules and the traced graphs (~4x the weights; ~15 GB at
full size, the README's "~16 GB RAM"); `build quantize` checks its own,
finer estimate again before it starts."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cosyedge_build.pull.hub import RepoFile
from cosyedge_models.errors import CosyEdgeError

GIB = 1 << 30
BASE_MEMORY = int(1.0 * GIB)  # Python, torch, transformers, onnx
EXPORT_MEMORY_FACTOR = 4.0
QUANTIZE_MEMORY_FACTOR = 3.0  # docs/memory.md: 10.4 GiB peak for int8 at full size
VARIANT_RATIO = {"fp32": 0.0, "fp16": 0.5, "int8": 0.35, "int8w": 0.35}
ENGINE_RATIO = 0.6
MARGIN = 256 << 20
WEIGHT_SUFFIXES = (".pt", ".safetensors")


class ResourceError(CosyEdgeError):
    """The pull would not fit this host; nothing was started."""


@dataclass(frozen=True)
class Needs:
    disk_bytes: int
    memory_bytes: int
    parts: dict[str, int]  # what the disk need is made of


def weight_bytes(files: Iterable[RepoFile]) -> int:
    return sum(f.size or 0 for f in files if f.path.endswith(WEIGHT_SUFFIXES))


def bundle_bytes(files: Iterable[RepoFile]) -> int:
    """The fp32 bundle: the stage weights (not the Qwen2 folder, whose weights llm.pt overrides)."""
    return sum(f.size or 0 for f in files if "/" not in f.path and f.path.endswith((".pt", ".onnx")))


def estimate(files: list[RepoFile], precision: str, engines: bool, to_download: int,
             export_done: bool, variant_done: bool) -> Needs:
    """What is still needed: the bytes left to download, the bundles not yet built."""
    fp32 = bundle_bytes(files)
    parts = {"download": to_download,
             "fp32 bundle": 0 if export_done else int(fp32 * 1.1),
             f"{precision} variant": 0 if variant_done else int(fp32 * VARIANT_RATIO[precision]),
             "TensorRT engines": int(fp32 * ENGINE_RATIO) if engines else 0}
    weights = weight_bytes(files)
    memory = 0 if export_done else int(BASE_MEMORY + EXPORT_MEMORY_FACTOR * weights)
    if precision != "fp32" and not variant_done:
        memory = max(memory, int(BASE_MEMORY + QUANTIZE_MEMORY_FACTOR * fp32))
    return Needs(sum(parts.values()) + MARGIN, memory, parts)


def check(needs: Needs, folder: Path, free_disk: int | None = None, free_memory: int | None = None) -> None:
    """Raise ResourceError saying what does not fit (both, when both)."""
    if free_disk is None:
        probe = folder
        while not probe.exists():
            probe = probe.parent
        free_disk = shutil.disk_usage(probe).free
    problems = []
    if needs.disk_bytes > free_disk:
        made_of = ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in needs.parts.items() if v)
        problems.append(f"disk: about {needs.disk_bytes / GIB:.1f} GiB needed in {folder} ({made_of}), "
                        f"{free_disk / GIB:.1f} GiB free")
    if free_memory is not None and needs.memory_bytes > free_memory:
        problems.append(f"memory: the build needs about {needs.memory_bytes / GIB:.1f} GiB at its peak, "
                        f"{free_memory / GIB:.1f} GiB available")
    if problems:
        raise ResourceError("this pull does not fit here: " + "; ".join(problems) + ". Free space or memory, "
                            "choose another --bundles-dir, or build on a larger host and copy the bundle "
                            "(docs/models.md); --skip-resource-check starts anyway")
