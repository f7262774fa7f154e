"""The fixed-length vocoder graphs batched across streams ([tts] graph_vocoder_batch; issue 23).

Each stream's chunk of a recurring length is one replay of that length's graph on the graph thread
(models/backends/ort_static_vocoder.py); with many streams those replays took 10-18 % of the graph
threads' busy time on the H200 (docs/gpu.md, twenty-first run). `build export --static-vocoder
--batch-flow-sizes` also writes `hift_batch_b<B>_f<N>` (edge_build/export/hift_static.py): the same graph
over B rows, each with its own mel, noise, source cache and cache_on, so a first chunk and later chunks
share a replay. A call of a length with batched graphs queues itself and submits a turn on the graph
thread at its caller's priority (first audio first); a turn takes the calls of the oldest waiting call's
length that wait then: one alone on the single-stream graph, several as one replay of the smallest batch
size that holds them (at most the largest; rows past them zero, their outputs dropped). A call's outputs
are copied out before its turn ends, so one set of buffers per graph serves every stream. Captured on
ort-cuda at load (`warm_up`); a capture that fails leaves the single-stream graphs serving."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort
from cosyedge_models.backends.base import Session
from cosyedge_models.backends.fixed_shapes import source_cache
from cosyedge_models.backends.graph_thread import CAPTURE_RUNS
from cosyedge_models.backends.ort import OrtSession
from cosyedge_models.backends.ort_static_vocoder import StaticVocoder
from cosyedge_models.batching.batched_flow import batched_stages
from cosyedge_models.batching.turns import TurnQueue
from cosyedge_models.bundle.loader import BATCH_VOCODER_NAME, Bundle
from cosyedge_models.errors import BundleError, SynthesisError

log = logging.getLogger(__name__)

_INPUTS = ("mel", "noise", "cache_source", "cache_on")
_OUTPUTS = ("audio", "source")


@dataclass
class VocoderBatchStats:
    """What the batching did (bench output, tests)."""

    replays: int = 0  # batched-graph replays
    rows: int = 0  # chunks they served
    alone: int = 0  # turns that found one call and ran it on the single-stream graph
    peak_batch: int = 0  # most chunks in one replay

    def as_dict(self) -> dict[str, int]:
        return {"replays": self.replays, "rows": self.rows, "alone": self.alone, "peak_batch": self.peak_batch}


@dataclass
class _Call:
    frames: int
    mel: np.ndarray
    noise: np.ndarray
    cache: np.ndarray | None
    future: Future[tuple[np.ndarray, np.ndarray]] = field(default_factory=Future)


class _BatchIO:
    """One (batch size, length) graph with its device buffers, bound once."""

    def __init__(self, session: OrtSession, device: tuple[str, int]) -> None:
        kind, dev = device
        self.session = session
        declared = {**session.input_shapes, **session.output_shapes}
        self.shapes = {n: tuple(int(d) for d in shape) for n, shape in declared.items()}
        self.batch, self.frames = self.shapes["mel"][0], self.shapes["mel"][2]
        self.values = {name: ort.OrtValue.ortvalue_from_shape_and_type(list(self.shapes[name]), np.float32, kind, dev)
                       for name in (*_INPUTS, *_OUTPUTS)}
        self.binding = session.io_binding()
        for name in _INPUTS:
            self.binding.bind_ortvalue_input(name, self.values[name])
        for name in _OUTPUTS:
            self.binding.bind_ortvalue_output(name, self.values[name])

    def run(self, calls: list[_Call]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each call's (audio [1, N*U], source [1, 1, N*U]), as the single-stream graph gives it."""
        feeds = {name: np.zeros(self.shapes[name], np.float32) for name in _INPUTS}
        for i, call in enumerate(calls):
            feeds["mel"][i] = call.mel[0]
            feeds["noise"][i] = call.noise[0]
            if call.cache is not None:
                feeds["cache_source"][i] = call.cache[0]
                feeds["cache_on"][i] = 1.0
        for name in _INPUTS:
            self.values[name].update_inplace(feeds[name])
        self.session.run_bound(self.binding)
        audio, source = (np.asarray(self.values[name].numpy()) for name in _OUTPUTS)
        return [(audio[i:i + 1].copy(), source[i:i + 1].copy()) for i in range(len(calls))]


class BatchedVocoder:
    """The engine's fixed-length vocoder (FixedLengthVocoder, models/synthesis/vocoder.py): `single`'s
    graphs, and the batched graphs of the lengths that have them. Call `warm_up()` before serving."""

    def __init__(self, single: StaticVocoder, sessions: Mapping[tuple[int, int], OrtSession]) -> None:
        self.single = single
        self.thread = single.thread
        self.frames = single.frames
        self._sessions = dict(sessions)
        self._io: dict[tuple[int, int], _BatchIO] = {}
        self.batch_sizes = sorted({b for b, _ in sessions})
        self._batched_frames = {n for _, n in sessions}  # the lengths with batched graphs
        self.capture = all(s.cuda_graph for s in sessions.values())
        self.stats = VocoderBatchStats()
        self.disabled: str | None = None  # a capture at load failed: the single-stream graphs serve
        self._lock = threading.Lock()  # the calls waiting and the stats
        self._turns = TurnQueue[_Call](self.thread, self._serve, "vocoder_graph", self._lock)

    @property
    def replays(self) -> int:
        """Chunks served by the fixed-length graphs, single or batched."""
        return self.single.replays + self.stats.rows

    def warm_up(self) -> None:
        self.thread.call(self._warm_up)

    def _warm_up(self) -> None:
        try:
            for key, session in sorted(self._sessions.items()):
                io = _BatchIO(session, self.single.device)
                self._io[key] = io
                rows = [_Call(io.frames, np.zeros((1, *io.shapes["mel"][1:]), np.float32),
                              np.zeros((1, *io.shapes["noise"][1:]), np.float32), None)]
                for _ in range(CAPTURE_RUNS if self.capture else 1):
                    io.run(rows)
        except SynthesisError as exc:
            self.disabled = str(exc)[:500]
            self._io.clear()
            log.warning("batched vocoder graphs disabled at load, the single-stream graphs serve: %s", exc)

    def run(self, mel: np.ndarray, noise: np.ndarray, cache: np.ndarray | None) -> tuple[
            np.ndarray, np.ndarray] | None:
        """(audio, source) for mel [1, C, N] as HiftVocoder.run computes it, or None where no graph fits."""
        cache = source_cache(cache)
        frames = self.single.fitting(mel.shape, cache)
        if (frames is None or self.disabled is not None or frames not in self._batched_frames
                or self.thread.on_thread()):  # on the graph thread itself: inline, as GraphThread.call runs it
            return self.single.run(mel, noise, cache)
        call = _Call(frames, mel, noise, cache)
        self._turns.queue(call)  # a turn at the caller's priority
        return call.future.result()

    def _serve(self) -> None:
        """On the graph thread: the calls of the oldest waiting call's length, in one replay (an empty
        group where this turn's call was served by an earlier turn)."""
        batch = self._turns.take(self._oldest_length)
        self._turns.settle(batch, lambda: self._replay(batch))

    def _oldest_length(self, pending: list[_Call]) -> list[_Call]:
        """The calls of the oldest one's length, at most the largest batch size (oldest first)."""
        return [c for c in pending if c.frames == pending[0].frames][:self.batch_sizes[-1]]

    def _replay(self, batch: list[_Call]) -> list[tuple[np.ndarray, np.ndarray]]:
        """One alone on the single-stream graph, several on the smallest batch size that holds them;
        counted in the stats before their callers get their outputs."""
        frames = batch[0].frames
        self.thread.note(f"rows {len(batch)}, frames {frames}")
        if len(batch) == 1:
            call = batch[0]
            outs = [self.single.replay(frames, call.mel, call.noise, call.cache)]
        else:
            size = next(b for b in self.batch_sizes if b >= len(batch))
            outs = self._io[(size, frames)].run(batch)
        with self._lock:
            s = self.stats
            if len(batch) == 1:
                s.alone += 1
            else:
                s.replays += 1
                s.rows += len(batch)
                s.peak_batch = max(s.peak_batch, len(batch))
        return outs

    def close(self) -> None:
        self._io.clear()
        self.single.close()


def batch_vocoder_sessions(bundle: Bundle, load: Callable[[str, Path], Session]) -> dict[tuple[int, int], Session]:
    """The bundle's batched vocoder graphs (`hift_batch_b<B>_f<N>`) by (batch size, mel frames), loaded."""
    return batched_stages(bundle, BATCH_VOCODER_NAME, load)


def with_batched_vocoder(single: StaticVocoder, bundle: Bundle, load: Callable[[str], Session]
                         ) -> StaticVocoder | BatchedVocoder:
    """`single` with the bundle's batched graphs of its lengths (graph_vocoder_batch), captured now; an
    error where the bundle has none; `single` alone where their capture failed."""
    loaded = batch_vocoder_sessions(bundle, lambda name, _path: load(name))
    if not loaded:
        raise BundleError(f"{bundle.root}: graph_vocoder_batch needs a bundle exported by this version with "
                          "'--static-vocoder --static-flow-windows W,... --batch-flow-sizes 1,2,...'")
    sessions = {key: s for key, s in loaded.items() if isinstance(s, OrtSession) and key[1] in single.frames}
    if not sessions:
        return single  # a wrapped backend (tests), or none of its lengths
    vocoder = BatchedVocoder(single, sessions)
    vocoder.warm_up()
    if vocoder.disabled is not None:
        return single
    log.info("vocoder: batched fixed-length graphs for batch sizes %s", vocoder.batch_sizes)
    return vocoder
