"""The fixed-length vocoder graphs (build export --static-vocoder; stages
`STATIC_VOCODER_PREFIX + F`) as TensorRT engines replayed as CUDA graphs:
the TensorRT counterpart of models/backends/ort_static_vocoder.py.

Each engine is hift_source and hift_decoder of one recurring chunk length
with static shapes only, so one context with its tensor addresses set once
serves it, and its enqueue (mel, noise, source cache and flag up; the
engine; audio and source down) is captured once into a CUDA graph at load
(models/backends/tensorrt/graph.py). A call is one piece of work on the engine's
GraphThread, which runs one call at a time: one set of buffers per length,
and one activation scratch for all lengths, serve every stream. Lengths
without an engine, batches and source caches of another length go to the
dynamic engines (`run` returns None; the choice is fixed_shapes.vocoder_length).

Type-checked against tensorrt-stubs; never run: no machine here has TensorRT."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
from cosyedge_models.backends.base import Session
from cosyedge_models.backends.cuda import DeviceBuffer, ThreadCuda
from cosyedge_models.backends.fixed_shapes import fixed_shape_names, fixed_shapes_wanted, source_cache, vocoder_length
from cosyedge_models.backends.graph_thread import GraphThread
from cosyedge_models.backends.tensorrt.graph import (
    CapturedEnqueue,
    CapturedRuntime,
    TensorBuffers,
    execute,
    set_addresses,
    user_context,
)
from cosyedge_models.backends.tensorrt.session import TrtSession
from cosyedge_models.bundle.loader import STATIC_VOCODER_PREFIX, Bundle
from cosyedge_models.errors import SynthesisError

log = logging.getLogger(__name__)

_INPUTS = ("mel", "noise", "cache_source", "cache_on")
_OUTPUTS = ("audio", "source")
WHAT = ("graph_vocoder on trt needs a bundle exported with 'cosyedge build export --static-vocoder' and its "
        "engines built with 'cosyedge build engines'")


class _Length:
    """One mel length's engine, its buffers and its captured run."""

    def __init__(self, session: TrtSession, scratch: DeviceBuffer, cuda: ThreadCuda) -> None:
        self.session = session
        self.io = TensorBuffers(session, (*_INPUTS, *_OUTPUTS))
        wrong = [n for n in self.io.dtypes if self.io.dtypes[n] != np.float32]
        if wrong:
            raise SynthesisError(f"{session.name}: {wrong} are not fp32 in this engine")
        self.frames = int(self.io.shapes["mel"][2])
        self.cache_len = int(self.io.shapes["cache_source"][2])
        self._cuda = cuda
        self._ctx = user_context(session, scratch)
        set_addresses(session, self._ctx, {n: self.io.ptr(n) for n in (*_INPUTS, *_OUTPUTS)})
        self.captured = CapturedEnqueue(session.name, self._ctx, cuda, self._enqueue)

    def _enqueue(self) -> None:
        self.io.upload(self._cuda, _INPUTS)
        execute(self.session, self._ctx, self._cuda)
        self.io.download(self._cuda, _OUTPUTS)

    def run(self, mel: np.ndarray, noise: np.ndarray, cache: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        io = self.io
        io.host("mel")[...] = mel
        io.host("noise")[...] = noise
        io.host("cache_source")[...] = 0.0 if cache is None else cache
        io.host("cache_on")[...] = 0.0 if cache is None else 1.0
        self.captured.run()
        self._cuda.synchronize()
        return np.array(io.host("audio")), np.array(io.host("source"))

    def close(self) -> None:
        self.captured.close()
        self.io.close()


class TrtStaticVocoder(CapturedRuntime):
    """The fixed-length vocoder engines of one engine, run on `thread`. `warm_up()`
    (before serving) binds every length and captures its graph."""

    what = "fixed-length vocoder engines"

    def __init__(self, sessions: Sequence[TrtSession], thread: GraphThread, capture: bool = True) -> None:
        super().__init__(sessions, thread, capture)
        self._lengths: dict[int, _Length] = {}
        self.frames: list[int] = []
        self.replays = 0  # chunks served here (tests, logs); counted on the graph thread

    def _make(self, cuda: ThreadCuda, scratch: DeviceBuffer) -> None:
        for session in self._sessions:
            length = _Length(session, scratch, cuda)
            length.io.zero_host()
            self._lengths[length.frames] = length
            self.prepare(length.captured)
        self.frames = sorted(self._lengths)

    def run(self, mel: np.ndarray, noise: np.ndarray, cache: np.ndarray | None) -> tuple[
            np.ndarray, np.ndarray] | None:
        """(audio, source) for mel [1, C, N] as HiftVocoder.run computes it, or None where
        no engine fits (another length, batch or source-cache length)."""
        if self.disabled is not None:
            return None
        cache = source_cache(cache)
        frames = vocoder_length({n: v.cache_len for n, v in self._lengths.items()}, mel.shape, cache)
        if frames is None:
            return None
        length = self._lengths[frames]

        def work() -> tuple[np.ndarray, np.ndarray]:
            out = length.run(mel, noise, cache)
            self.replays += 1
            return out

        return self.thread.call(work)

    def _dispose(self) -> None:
        lengths, self._lengths = self._lengths, {}
        for length in lengths.values():
            length.close()


def load_trt_static_vocoder(bundle: Bundle, backend_name: str, load: Callable[[str], Session],
                            setting: bool | None, thread: Callable[[], GraphThread]) -> TrtStaticVocoder | None:
    """The bundle's fixed-length vocoder engines, captured now, or None. `setting`: None auto
    (on for trt when the bundle has the engines), True on (an error without them), False off."""
    names = fixed_shape_names(bundle.stages, STATIC_VOCODER_PREFIX)
    if not (fixed_shapes_wanted(names, setting, backend_name, bundle.root, WHAT) and backend_name == "trt"):
        return None
    sessions = [load(n) for n in names]
    trt_sessions = [s for s in sessions if isinstance(s, TrtSession)]
    if len(trt_sessions) != len(sessions):
        return None  # a wrapped backend (tests): the dynamic engines
    vocoder = TrtStaticVocoder(trt_sessions, thread())
    vocoder.warm_up()
    log.info("vocoder: fixed-length TensorRT engines for %s mel frames%s%s", vocoder.frames,
             ", CUDA graphs" if vocoder.capture else "",
             f" (disabled: {vocoder.disabled})" if vocoder.disabled else "")
    return vocoder
