"""The LLM weights that several graphs of a bundle share (one data file,
written by edge_build/export/shared_weights.py), mapped once and handed to
every onnxruntime session that uses them as user-provided initializers, so
that prefill, decode and the fixed-size decode step hold one copy together.

The index beside the data file (`llm_weights.json`, or
`llm_weights.<precision>.json` for a quantized bundle's graphs):
`{"format": INDEX_FORMAT, "file": "llm_weights.bin", "graphs": [...],
"bytes": N, "tensors": {name: {"offset", "nbytes", "dtype", "shape"}}}`.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from cosyedge_models.errors import BundleError

log = logging.getLogger(__name__)

INDEX_FORMAT = "cosyedge-shared-weights-1"
INDEX_GLOB = "llm_weights*.json"
ALIGN = 1 << 16  # offsets of shared tensors: mappable on every page size up to 64 KiB
MIN_SHARED_BYTES = 1024  # smaller initializers stay inline in each graph


def read_index(path: Path) -> dict[str, Any]:
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BundleError(f"{path}: cannot read the shared weights index: {exc}") from exc
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        raise BundleError(f"{path}: not a shared weights index (expected format {INDEX_FORMAT!r})")
    return index


def find_index(graph: Path) -> Path | None:
    """The index that lists `graph` among its graphs, if any."""
    for path in sorted(graph.parent.glob(INDEX_GLOB)):
        index = read_index(path)
        if graph.name in index.get("graphs", []):
            return path
    return None


def shared_bytes(root: Path, graph_files: list[str]) -> dict[str, int]:
    """data file -> bytes, for the shared data files these graphs use (the memory budget's "once")."""
    out: dict[str, int] = {}
    for path in sorted(Path(root).glob(INDEX_GLOB)):
        index = read_index(path)
        if set(index.get("graphs", [])) & set(graph_files):
            out[str(index["file"])] = int(index.get("bytes", 0))
    return out


def graph_shared_bytes(root: Path) -> dict[str, int]:
    """graph file -> bytes of the shared weights it uses (those live outside its own file):
    the tensors themselves, without the alignment padding of the data file (which
    dominates a tiny model's sizes)."""
    out: dict[str, int] = {}
    for path in sorted(Path(root).glob(INDEX_GLOB)):
        index = read_index(path)
        held = sum(int(t["nbytes"]) for t in index.get("tensors", {}).values())
        for graph in index.get("graphs", []):
            out[str(graph)] = out.get(str(graph), 0) + held
    return out


class SharedWeights:
    """One mapped data file and its tensors as numpy views (no copy); the
    backend builds its runtime values (OrtValue) over them. Counted
    references: the mapping goes with the last session that used it."""

    def __init__(self, index_path: Path) -> None:
        index = read_index(index_path)
        self.index_path = index_path
        self.data_path = index_path.parent / str(index["file"])
        self.graphs = tuple(index.get("graphs", []))
        self.nbytes = int(index.get("bytes", 0))
        try:
            self._map: np.memmap | None = np.memmap(self.data_path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:
            raise BundleError(f"{self.data_path}: cannot map the shared LLM weights: {exc}") from exc
        self.arrays: dict[str, np.ndarray] = {}
        for name, t in index["tensors"].items():
            offset, nbytes = int(t["offset"]), int(t["nbytes"])
            if offset + nbytes > self._map.size:
                raise BundleError(f"{self.data_path}: tensor {name!r} lies beyond the file's end; re-export")
            dtype = np.dtype(t["dtype"])
            view = np.frombuffer(self._map, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset)
            self.arrays[name] = view.reshape(tuple(int(d) for d in t["shape"]))
        self._users = 0
        self._lock = threading.Lock()
        self.values: dict[str, Any] = {}  # the backend's runtime values, by tensor name

    def acquire(self) -> None:
        with self._lock:
            self._users += 1

    def release(self) -> bool:
        """True when that was the last user (the mapping is dropped)."""
        with self._lock:
            self._users -= 1
            if self._users > 0:
                return False
            self.values.clear()
            self.arrays.clear()
            self._map = None
            return True


class SharedWeightsRegistry:
    """The open shared data files of one backend, by index path."""

    def __init__(self) -> None:
        self._open: dict[Path, SharedWeights] = {}
        self._lock = threading.Lock()

    def for_graph(self, graph: Path) -> SharedWeights | None:
        index = find_index(graph)
        if index is None:
            return None
        key = index.resolve()
        with self._lock:
            shared = self._open.get(key)
            if shared is None:
                shared = self._open[key] = SharedWeights(index)
                log.info("%s: %d tensors (%.1f MB) shared by %s", shared.data_path.name, len(shared.arrays),
                         shared.nbytes / 1e6, ", ".join(shared.graphs))
            shared.acquire()
            return shared

    def release(self, shared: SharedWeights) -> None:
        with self._lock:
            if shared.release():
                self._open.pop(shared.index_path.resolve(), None)

    def open_files(self) -> Mapping[Path, SharedWeights]:
        return dict(self._open)
