"""One graph as several sessions, each kept on one input shape.

Measured on the H200 (edge_build/tools/device_stream_probe.py): onnxruntime's CUDA
convolutions set themselves up again whenever a node's input shape differs
from its previous call (cuDNN algorithm and workspace per node, only the last
shape kept), and for HiFT's decoder that costs 150-200 ms a call against 4-7
ms at an unchanged shape. Streaming alternates shapes (the first chunk, the
steady chunks with their mel overlap, a last chunk of any length; the next
request starts again with the first), so every request paid it two or three
times, the first chunk included. Here each distinct shape gets its own
session (up to `max_sessions`, least recently used one reused), so the
recurring shapes never change under a session: the first and steady chunks
cost what the graph costs. The memory price is one copy of the graph's
weights per session (HiFT: tens of MB)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from cosyedge_models.backends.base import Session


class ShapePinnedSession:
    """Session over up to `max_sessions` sessions of one graph, keyed by the
    shapes of the inputs (one call at a time per session)."""

    def __init__(self, load: Callable[[], Session], max_sessions: int = 3) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        first = load()
        self._load = load
        self.name = first.name
        self.input_names = first.input_names
        self.output_names = first.output_names
        self.max_sessions = max_sessions
        self._idle: list[Session] = [first]
        self._all: list[Session] = [first]
        self._by_shape: OrderedDict[tuple[tuple[int, ...], ...], Session] = OrderedDict()
        self._busy: set[int] = set()
        self._lock = threading.Lock()
        self.loads = 1  # sessions created (tests, logs)

    def _take(self, key: tuple[tuple[int, ...], ...]) -> Session:
        with self._lock:
            sess = self._by_shape.get(key)
            if sess is not None and id(sess) not in self._busy:
                self._by_shape.move_to_end(key)
            else:
                free = [s for s in self._all if id(s) not in self._busy]
                pinned = set(map(id, self._by_shape.values()))
                unpinned = [s for s in free if id(s) not in pinned]
                if unpinned:
                    sess = unpinned[0]
                elif len(self._all) < self.max_sessions:
                    sess = None
                else:  # reuse the least recently used free one
                    sess = next((s for k, s in self._by_shape.items() if id(s) not in self._busy), None)
                if sess is None:
                    sess = self._load()
                    self.loads += 1
                    self._all.append(sess)
                for k in [k for k, s in self._by_shape.items() if s is sess]:
                    del self._by_shape[k]
                self._by_shape[key] = sess
            self._busy.add(id(sess))
            return sess

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        key = tuple(tuple(int(d) for d in np.shape(inputs[n])) for n in sorted(inputs))
        sess = self._take(key)
        try:
            return sess.run(inputs, outputs)
        finally:
            with self._lock:
                self._busy.discard(id(sess))

    def pinned_shapes(self) -> list[tuple[tuple[int, ...], ...]]:
        """The input shapes (sorted by input name) that have a session now."""
        with self._lock:
            return list(self._by_shape)

    def memory_bytes(self) -> int:
        return sum(s.memory_bytes() for s in self._all)

    def close(self) -> None:
        for s in self._all:
            s.close()
        self._all.clear()
        self._by_shape.clear()
