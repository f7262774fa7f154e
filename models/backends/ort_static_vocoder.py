"""The fixed-length vocoder graphs (build export --static-vocoder) as CUDA
graphs on onnxruntime's CUDA provider.

Each graph (edge_build/export/hift_static.py) is hift_source and
hift_decoder of one recurring chunk length with only static shapes, so
onnxruntime captures it (`enable_cuda_graph`) and a chunk's vocoder is one
launch. Its inputs and outputs are device buffers bound once; a call is one
piece of work on the engine's GraphThread (inputs in, replay, outputs out),
like the other captured stages (models/backends/graph_thread.py says why),
and all captures happen there at load (`warm_up`). A call copies its outputs
out before it returns, so one set of buffers per length serves every stream.
Lengths outside the set, and a source cache of another length, go to the
dynamic sessions (`run` returns None). On the CPU the same graphs run
without capture: that is how they are tested."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import numpy as np
import onnxruntime as ort
from cosyedge_models.backends.base import Session
from cosyedge_models.backends.fixed_shapes import source_cache, vocoder_length
from cosyedge_models.backends.graph_thread import CAPTURE_RUNS, GraphThread
from cosyedge_models.backends.ort import OrtSession, fixed_shape_sessions
from cosyedge_models.bundle.loader import STATIC_VOCODER_PREFIX, Bundle
from cosyedge_models.errors import SynthesisError

log = logging.getLogger(__name__)


class _LengthIO:
    """One length's graph with its device buffers, bound once."""

    def __init__(self, session: OrtSession, device: tuple[str, int]) -> None:
        kind, dev = device
        self.session = session
        shapes = {**session.input_shapes, **session.output_shapes}
        self.frames = int(shapes["mel"][2])
        self.cache_len = int(shapes["cache_source"][2])
        self.values = {name: ort.OrtValue.ortvalue_from_shape_and_type([int(d) for d in shapes[name]], np.float32,
                                                                         kind, dev)
                       for name in ("mel", "noise", "cache_source", "cache_on", "audio", "source")}
        self.binding = session.io_binding()
        for name in ("mel", "noise", "cache_source", "cache_on"):
            self.binding.bind_ortvalue_input(name, self.values[name])
        for name in ("audio", "source"):
            self.binding.bind_ortvalue_output(name, self.values[name])
        self.zeros = np.zeros((1, 1, self.cache_len), np.float32)

    def run(self, mel: np.ndarray, noise: np.ndarray, cache: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        v = self.values
        v["mel"].update_inplace(mel)
        v["noise"].update_inplace(noise)
        v["cache_source"].update_inplace(self.zeros if cache is None else np.ascontiguousarray(cache, np.float32))
        v["cache_on"].update_inplace(np.array([0.0 if cache is None else 1.0], np.float32))
        self.session.run_bound(self.binding)
        return np.array(v["audio"].numpy()), np.array(v["source"].numpy())


class StaticVocoder:
    """The fixed-length graphs of one engine, run on `thread`. Call
    `warm_up()` before serving: it binds every length and captures its graph."""

    def __init__(self, sessions: Sequence[OrtSession], device: tuple[str, int], thread: GraphThread) -> None:
        self.device = device
        self.thread = thread
        self.capture = all(s.cuda_graph for s in sessions)
        self._sessions = list(sessions)
        self._io: dict[int, _LengthIO] = {}
        self.frames = sorted(int(s.input_shapes["mel"][2]) for s in sessions)
        self.replays = 0  # chunks served here (tests, logs); counted on the graph thread
        self.disabled: str | None = None  # set when a capture at load failed: the dynamic sessions serve

    def warm_up(self) -> None:
        self.thread.call(self._warm_up)

    def _warm_up(self) -> None:
        try:
            for session in self._sessions:
                io = _LengthIO(session, self.device)
                self._io[io.frames] = io
                mel = np.zeros(io.values["mel"].shape(), np.float32)
                noise = np.zeros(io.values["noise"].shape(), np.float32)
                for _ in range(CAPTURE_RUNS if self.capture else 1):
                    io.run(mel, noise, None)
        except SynthesisError as exc:
            self.disabled = str(exc)[:500]
            log.warning("fixed-length vocoder graphs disabled at load, the dynamic sessions take over: %s", exc)

    def run(self, mel: np.ndarray, noise: np.ndarray, cache: np.ndarray | None) -> tuple[
            np.ndarray, np.ndarray] | None:
        """(audio, source) for mel [1, C, N] as HiftVocoder.run computes it, or
        None where no graph fits (another length, batch or cache length)."""
        cache = source_cache(cache)
        frames = self.fitting(mel.shape, cache)
        if frames is None:
            return None
        return self.thread.call(functools.partial(self.replay, frames, mel, noise, cache), label="vocoder_graph")

    def fitting(self, mel_shape: tuple[int, ...], cache: np.ndarray | None) -> int | None:
        """The length whose graph serves a chunk of `mel_shape` with `cache` (source_cache's), or None."""
        frames = vocoder_length({n: io.cache_len for n, io in self._io.items()}, mel_shape, cache)
        return frames if frames is not None and frames in self._io and self.disabled is None else None

    def replay(self, frames: int, mel: np.ndarray, noise: np.ndarray,
               cache: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """On the graph thread: one chunk through its length's graph (run's work; the batched
        vocoder's lone calls, models/batching/batched_vocoder.py)."""
        out = self._io[frames].run(mel, noise, cache)
        self.replays += 1
        return out

    def close(self) -> None:
        self._io.clear()


def load_static_vocoder(bundle: Bundle, backend_name: str, load: Callable[[str], Session],
                        setting: bool | None, thread: Callable[[], GraphThread]) -> StaticVocoder | None:
    """The bundle's fixed-length vocoder graphs, captured now, or None. `setting`:
    None auto (on for ort-cuda when the bundle has them), True: on (an error
    without them), False: off."""
    found = fixed_shape_sessions(bundle, backend_name, load, setting, STATIC_VOCODER_PREFIX,
                                 "graph_vocoder needs a bundle exported with 'cosyedge build export --static-vocoder'")
    if found is None:
        return None
    vocoder = StaticVocoder(*found, thread())
    vocoder.warm_up()
    log.info("vocoder: fixed-length graphs for %s mel frames%s%s", vocoder.frames,
             ", CUDA graphs" if vocoder.capture else "",
             f" (disabled: {vocoder.disabled})" if vocoder.disabled else "")
    return vocoder
