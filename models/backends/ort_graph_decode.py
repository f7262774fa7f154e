"""The LLM decode loop as CUDA graphs on onnxruntime's CUDA provider.

Measured on the H200: one decode step of the full-size LLM is ~1,700
kernels and took 8 ms, launch-bound (a few µs per kernel); the dynamic
graph cannot be captured because its shape arithmetic runs on the CPU. The
bundle's optional `llm_decode_static` step (build export --static-decode-len)
has only fixed shapes: the cache is a fixed number of positions, the new
K/V are written at `position` inside the graph and later positions are
masked. onnxruntime then captures the whole step (`enable_cuda_graph`) and
replays it as one launch.

A captured graph replays on the device addresses it was captured with, so
each concurrent request borrows a `GraphSlot`: persistent device buffers
(the step's inputs, two caches used in turn as input and output, the
log-probabilities) and two graph ids, one per direction. Slots are reused
across requests; when all are busy, or a request may outgrow the cache,
the engine uses the ordinary decode loop instead. onnxruntime keeps captured
graphs per thread and captures in CUDA's global mode, so every run of the
step happens on the engine's GraphThread (models/backends/graph_thread.py):
every slot is made and both its graphs captured there at load (`warm_up`),
and a request's step is one piece of work there (inputs in, replay, logp
out); the prefill and the cache padding (dynamic sessions, never captured)
stay on the request's thread. On the CPU the same loop runs the same static
graph without capture (that is how it is tested)."""

from __future__ import annotations

import functools
import logging
import threading

import numpy as np
import onnxruntime as ort
from cosyedge_models.backends.graph_thread import CAPTURE_RUNS, GraphPriority, GraphThread
from cosyedge_models.backends.ort import OrtSession, bound_lm_run
from cosyedge_models.errors import SynthesisError

log = logging.getLogger(__name__)


class GraphSlot:
    """One request's device buffers for the static step, bound once."""

    def __init__(self, index: int, step: OrtSession, device: tuple[str, int], capture: bool) -> None:
        kind, dev = device
        cache = tuple(int(d) for d in step.input_shapes["past_kv"])
        hidden = int(step.input_shapes["inputs_embeds"][2])
        vocab = int(step.output_shapes["logp"][1])
        self.embeds = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, 1, hidden), np.float32), kind, dev)
        self.position = ort.OrtValue.ortvalue_from_numpy(np.zeros((1,), np.int64), kind, dev)
        self.kv = (ort.OrtValue.ortvalue_from_shape_and_type(cache, np.float32, kind, dev),
                   ort.OrtValue.ortvalue_from_shape_and_type(cache, np.float32, kind, dev))
        self.logp = ort.OrtValue.ortvalue_from_shape_and_type((1, vocab), np.float32, kind, dev)
        self.bindings = []
        self.run_options = []
        for src in (0, 1):
            binding = step.io_binding()
            binding.bind_ortvalue_input("inputs_embeds", self.embeds)
            binding.bind_ortvalue_input("position", self.position)
            binding.bind_ortvalue_input("past_kv", self.kv[src])
            binding.bind_ortvalue_output("logp", self.logp)
            binding.bind_ortvalue_output("present_kv", self.kv[1 - src])
            self.bindings.append(binding)
            options = ort.RunOptions()
            if capture:  # one captured graph per slot and direction
                options.add_run_config_entry("gpu_graph_id", str(1 + 2 * index + src))
            self.run_options.append(options)
        self.positions = cache[4]
        self.index = index


class GraphDecoder:
    """The slots over one loaded static step (one per engine), run on `thread`.
    Call `warm_up()` before serving: it makes every slot and captures its graphs."""

    def __init__(self, prefill: OrtSession, step: OrtSession, pad: OrtSession, device: tuple[str, int],
                 thread: GraphThread, slots: int = 4, decode: OrtSession | None = None) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.prefill_session = prefill
        # The dynamic llm_decode: a prefill that starts from a voice's saved prefix runs the
        # prompt's rest through it (then pads into the slot as after llm_prefill). None: not offered.
        self.decode_session = decode
        self.step_session = step
        self.pad_session = pad
        self.device = device
        self.thread = thread
        self.capture = step.cuda_graph
        self.positions = int(step.input_shapes["past_kv"][4])
        self._max_slots = slots
        self._slots: list[GraphSlot] = []
        self._free: list[GraphSlot] = []
        self._lock = threading.Lock()
        # set when a capture at load failed: every request then uses the ordinary loop
        self.disabled: str | None = None

    @property
    def slots(self) -> int:
        """Requests that can hold a slot at once (graph_decode_slots)."""
        return self._max_slots

    def warm_up(self) -> None:
        """On the graph thread, before any request: every slot, and both of its
        graphs run CAPTURE_RUNS times (onnxruntime captures on the last; once
        without capture on the CPU). The slots' caches are rewritten by each
        request's prefill, so what these runs leave there is never read."""
        self.thread.call(self._warm_up)

    def _warm_up(self) -> None:
        runs = CAPTURE_RUNS if self.capture else 1
        with self._lock:
            while len(self._slots) < self._max_slots:
                slot = GraphSlot(len(self._slots), self.step_session, self.device, self.capture)
                self._slots.append(slot)
            self._free = list(reversed(self._slots))  # slot 0 is handed out first
            slots = list(self._slots)
        try:
            for slot in slots:
                slot.embeds.update_inplace(np.zeros(slot.embeds.shape(), np.float32))
                slot.position.update_inplace(np.zeros((1,), np.int64))
                for src in (0, 1):
                    for _ in range(runs):
                        self.step_session.run_bound(slot.bindings[src], slot.run_options[src])
        except SynthesisError as exc:
            self.disabled = str(exc)[:500]
            log.warning("fixed-size LLM decode disabled at load, the ordinary loop takes over: %s", exc)

    def loop(self, positions: int) -> GraphDecodeLoop | None:
        """A loop for a request of at most `positions` (prompt + speech tokens), or None: use the ordinary loop."""
        if positions > self.positions or self.disabled is not None:
            return None
        with self._lock:
            if self._free:
                slot = self._free.pop()
            elif len(self._slots) < self._max_slots:
                slot = GraphSlot(len(self._slots), self.step_session, self.device, self.capture)
                self._slots.append(slot)
            else:
                return None
        return GraphDecodeLoop(self, slot)

    def release(self, slot: GraphSlot) -> None:
        with self._lock:
            self._free.append(slot)

    def close(self) -> None:
        with self._lock:
            self._slots.clear()
            self._free.clear()


class GraphDecodeLoop:
    """DecodeLoop over the static step: prefill with the dynamic graph, its
    cache padded into the slot, then one (replayed) step per token."""

    def __init__(self, decoder: GraphDecoder, slot: GraphSlot) -> None:
        self._decoder = decoder
        self._slot: GraphSlot | None = slot
        self._src = 0
        self._len = 0
        self.takes_past = decoder.decode_session is not None

    def _slot_or_raise(self) -> GraphSlot:
        if self._slot is None:
            raise RuntimeError("the decode loop was closed")
        return self._slot

    def prefill(self, inputs_embeds: np.ndarray, past: np.ndarray | None = None) -> np.ndarray:
        slot = self._slot_or_raise()
        dec = self._decoder
        p = 0 if past is None else int(past.shape[4])
        t = p + inputs_embeds.shape[1]
        if inputs_embeds.shape[0] != 1 or t >= slot.positions:
            raise SynthesisError(f"static decode: a prompt of {t} positions does not fit {slot.positions}")
        if past is None:
            logp, present = bound_lm_run(dec.prefill_session, inputs_embeds, None, 0, dec.device)
        elif dec.decode_session is None:
            raise SynthesisError("static decode: this loop was not given llm_decode, so it cannot start from a past")
        else:
            logp, present = bound_lm_run(dec.decode_session, inputs_embeds, past, p, dec.device)
        pad = dec.pad_session.io_binding()
        pad.bind_ortvalue_input("present_kv", present)
        pad.bind_ortvalue_output("padded_kv", slot.kv[0])
        dec.pad_session.run_bound(pad)
        self._src = 0
        self._len = t
        return logp

    def step(self, inputs_embeds: np.ndarray) -> np.ndarray:
        slot = self._slot_or_raise()
        if self._len == 0:
            raise RuntimeError("step() before prefill()")
        if self._len >= slot.positions:
            raise SynthesisError(f"static decode: the cache of {slot.positions} positions is full")
        embeds = np.ascontiguousarray(inputs_embeds, dtype=np.float32).reshape(1, 1, -1)
        dec = self._decoder
        # LLM work: it waits while a stream's first chunk is on its way to audio (graph_thread.py)
        logp = dec.thread.call(functools.partial(_replay, dec.step_session, slot, self._src, embeds, self._len),
                               GraphPriority.LLM, "llm_step")
        self._src = 1 - self._src
        self._len += 1
        return logp

    @property
    def cache_len(self) -> int:
        return self._len

    def close(self) -> None:
        if self._slot is not None:
            self._decoder.release(self._slot)
            self._slot = None
        self._len = 0


def _replay(step: OrtSession, slot: GraphSlot, src: int, embeds: np.ndarray, position: int) -> np.ndarray:
    """One decode step on the graph thread: inputs in, replay, logp out."""
    slot.embeds.update_inplace(embeds)
    slot.position.update_inplace(np.array([position], dtype=np.int64))
    step.run_bound(slot.bindings[src], slot.run_options[src])
    return np.array(slot.logp.numpy())
