"""The pure logic of the fixed-shape (CUDA-graph) stages, shared by the
onnxruntime and the TensorRT runtimes: which stages a setting turns on,
which window bucket a call takes, the padding and the cache validity mask
it is fed, whether a step cache stays on the fixed shapes, which rows a
commit or a trim copies, how many request slots fit in the GPU's memory,
and which fixed-length vocoder graph a chunk takes.

No onnxruntime, no TensorRT, no CUDA here (the `trt` path runs without
onnxruntime, models/backends/tensorrt/static_flow.py); tested on the CPU in
tests/models/backends/test_fixed_shapes.py."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import numpy as np
from cosyedge_models.backends.flow_cache import trim_due
from cosyedge_models.backends.graph_thread import GraphThread, GraphThreadClosed
from cosyedge_models.errors import BundleError, SynthesisError

log = logging.getLogger(__name__)

# graph_flow auto takes at most this share of the GPU's memory for its slots: the rest is the
# engines', the arena's and the other requests' (dynamic graph).
AUTO_DEVICE_FRACTION = 0.25

# The backends whose auto setting (None) turns the fixed-shape stages on when the bundle has them.
AUTO_ON_BACKENDS = ("ort-cuda", "trt")


def fixed_shape_names(stages: Iterable[str], prefix: str) -> list[str]:
    """The bundle's stages of one fixed-shape family (`prefix` + size), sorted by name."""
    return sorted(n for n in stages if n.startswith(prefix))


def fixed_shapes_wanted(names: Sequence[str], setting: bool | None, backend_name: str, root: Path,
                        what: str) -> bool:
    """Whether a fixed-shape family runs: `setting` True on (a BundleError saying `what` when
    the bundle has none), None auto (on for AUTO_ON_BACKENDS when the bundle has them), False off."""
    if setting is True and not names:
        raise BundleError(f"{root}: {what}")
    wanted = setting if setting is not None else backend_name in AUTO_ON_BACKENDS
    return bool(wanted and names)


def bucket(windows: Sequence[int], frames: int) -> int | None:
    """Index of the smallest of the (ascending) `windows` that holds `frames`, or None."""
    for i, w in enumerate(windows):
        if frames <= w:
            return i
    return None


def pad_window(value: np.ndarray, window: int) -> np.ndarray:
    """`value` right-padded with zeros along its last axis to `window` frames, fp32 (padded
    frames get mask 0: exact, the convolutions are causal and padded keys are masked)."""
    out = np.zeros((*value.shape[:-1], window), dtype=np.float32)
    out[..., : value.shape[-1]] = value
    return out


def visible_first(length: int, visible: int) -> int:
    """The first cached frame a call attends to: all (-1) or only the last `visible`."""
    return 0 if visible < 0 else max(length - visible, 0)


def valid_mask(cache_frames: int, first: int, length: int) -> np.ndarray:
    """The fixed-shape graph's cache_valid [S]: 1 on the attended rows [first, length)."""
    valid = np.zeros((cache_frames,), np.float32)
    valid[first:length] = 1.0
    return valid


def commit_index(commit: int, history: int) -> np.ndarray:
    """The conv-input frames (history first) that become the next conv history."""
    return commit + np.arange(history, dtype=np.int64)


def stays_fixed(window: int | None, length: int, commit: int, cache_frames: int, disabled: bool) -> bool:
    """Whether a call stays on the fixed shapes: a window bucket holds it, the cache has room
    for its committed rows, and the graphs are not disabled."""
    return window is not None and length + commit <= cache_frames and not disabled


def prefix_fits(frames: int, windows: Sequence[int], cache_frames: int) -> bool:
    """Whether a saved voice's prefix of `frames` leaves room for at least the smallest window."""
    return frames + min(windows) <= cache_frames


@dataclass(frozen=True)
class RowCopy:
    """A device copy of `frames` K/V rows inside a slot's buffer (or from a window's output)."""

    dst: int  # frame index in the slot
    src: int  # frame index in the source (the slot, or the window's att_window)
    frames: int

    def nbytes(self, row_bytes: int) -> int:
        return self.frames * row_bytes


def commit_copy(at: int, commit: int) -> RowCopy | None:
    """The window's first `commit` rows (att_window) to slot frame `at`; None without a commit."""
    return RowCopy(at, 0, commit) if commit > 0 else None


def trim_copy(length: int, keep: int, cache_frames: int) -> RowCopy | None:
    """Bounded left context: the last `keep` rows to the front once trim_due says so, else None."""
    if keep < 0 or not trim_due(length, keep, cache_frames):
        return None
    return RowCopy(0, length - keep, keep)


def flow_request_bytes(att_cache: Sequence[int], conv_cache: Sequence[int], n_timesteps: int,
                       itemsize: int = 4) -> int:
    """Device memory of one request's slots (one per Euler step): K/V buffer and conv history."""
    return n_timesteps * itemsize * (int(np.prod(att_cache)) + int(np.prod(conv_cache)))


BATCH_SIZES = (1, 2, 4, 8, 16)  # the batch sizes a batched fixed-shape graph may be captured for


@dataclass(frozen=True)
class BatchPlan:
    """What the auto setting gives a device: request slots, the batch sizes captured (each
    replay serves up to the largest; more ready streams take more replays) and their bytes."""

    slots: int
    batch_sizes: tuple[int, ...]
    bytes: int


def plan_batches(requested_slots: int, per_slot_bytes: int, device_bytes: int,
                 per_batch_bytes: Mapping[int, int] | None = None, fixed_bytes: int = 0,
                 sizes: Sequence[int] = BATCH_SIZES, fraction: float = AUTO_DEVICE_FRACTION) -> BatchPlan:
    """The most slots (at most `requested_slots`) whose caches (`per_slot_bytes` each), the
    captured batch sizes up to the slots (`per_batch_bytes[b]`: what capturing size b costs,
    its activation and I/O buffers; 0 where absent) and `fixed_bytes` fit within `fraction`
    of `device_bytes`; slots 0 and no sizes where not even one stream fits."""
    if requested_slots < 0 or any(b < 1 for b in sizes) or list(sizes) != sorted(set(sizes)) or 1 not in sizes:
        raise ValueError(f"plan_batches: requested_slots >= 0 and sizes ascending from 1, got "
                         f"{requested_slots} and {list(sizes)}")
    costs = per_batch_bytes or {}
    budget = int(device_bytes * fraction)
    for slots in range(requested_slots, 0, -1):
        chosen = tuple(b for b in sizes if b <= slots)
        need = fixed_bytes + slots * max(per_slot_bytes, 0) + sum(costs.get(b, 0) for b in chosen)
        if need <= budget:
            return BatchPlan(slots, chosen, need)
    return BatchPlan(0, (), 0)


def slots_that_fit(requested: int, per_request_bytes: int, device_bytes: int,
                   fraction: float = AUTO_DEVICE_FRACTION, fixed_bytes: int = 0) -> int:
    """Requests given fixed-shape slots by the auto setting: at most `requested`, all of
    them with `fixed_bytes` within `fraction` of the device's memory (0: not even one fits);
    `plan_batches` without batched graphs."""
    if per_request_bytes <= 0:
        return requested
    return plan_batches(requested, per_request_bytes, device_bytes, fixed_bytes=fixed_bytes, fraction=fraction).slots


# The batched estimator lanes (graph_flow_batch) may take up to half the GPU, and no more than
# FREE_FRACTION of what is free when they are allocated: on a shared GPU another process's
# memory is not ours (a quarter of the total failed there with 70 GB held elsewhere).
BATCH_LANE_FRACTION = 0.5
FREE_FRACTION = 0.8
# single-stream estimator slots beside the batched lanes: the streams beyond the lanes (H200 run 7:
# seven of them beside eight lanes ran the GPU out of memory)
OVERFLOW_FLOW_SLOTS = 2
# rows a stream takes in the batched estimator graphs: its guidance pair (conditional, unconditional)
CFG_ROWS = 2


def lane_step_bytes(blocks: int, kv_row_values: int, conv_row_floats: int, kv_itemsize: int = 4) -> int:
    """Device memory of one stream's batched estimator cache at one Euler step (a lane of a group):
    its guidance pair's K and V rows of every block (`kv_itemsize` bytes a value: 4 fp32, 2 fp16)
    and fp32 conv history (the engine's lanes, models/batching/batched_flow.py; the boards' budget,
    models/bundle/memory_budget.py)."""
    return CFG_ROWS * (2 * blocks * kv_row_values * kv_itemsize + conv_row_floats * 4)


# What the batched lanes bring beyond their caches (measured on an H100 with onnxruntime 1.31,
# docs/benchmarks/capture-memory-h100-2026-12-05.json): each captured graph holds ~2 KB a kernel (1,991 B a
# node + 44 KB), so a captured estimator step of the fp32 graph's 6,810 kernels ~14 MB (the fused fp16
# lanes' 2,083: ~4 MB); each CUDA session ~155 MB once run (its cuBLAS and cuDNN handles and workspace).
# Intermediate tensors are not kept per captured graph (the session's arena serves them all).
CAPTURED_STEP_BYTES = 14_000_000
SESSION_DEVICE_BYTES = 160_000_000


def step_captures_bytes(groups: int, windows: int) -> int:
    """The captured graphs one stream's estimator caches bring: a graph of each window at each Euler step
    (`groups`), bound at its rows (a lane's batch-1 graphs; a single-stream slot's own)."""
    return groups * windows * CAPTURED_STEP_BYTES


def flow_slot_bytes(att_cache: Sequence[int], conv_cache: Sequence[int], n_timesteps: int, windows: int,
                    itemsize: int = 4) -> tuple[int, int]:
    """(per request, fixed): what the single-stream fixed-shape estimator slots take on ort-cuda. A request's
    caches (flow_request_bytes) and the graphs captured at them (step_captures_bytes: ~280 MB at full size
    with two windows, uncounted before 2026-12-07); once, a CUDA session a window. What graph_flow auto
    fits in AUTO_DEVICE_FRACTION of the GPU (plan_batches' per_slot_bytes and fixed_bytes)."""
    caches = flow_request_bytes(att_cache, conv_cache, n_timesteps, itemsize)
    return caches + step_captures_bytes(n_timesteps, windows), windows * SESSION_DEVICE_BYTES


def batch_flow_reserve(batch_sizes: Sequence[int], lanes: int, groups: int, windows: int) -> int:
    """What the batched estimator graphs hold beside the lanes: a session a (batch size, window), and
    the captures of each batch size above 1 up to `lanes` (one a group and window)."""
    batched = sum(1 for b in batch_sizes if 1 < b <= lanes)
    return len(batch_sizes) * windows * SESSION_DEVICE_BYTES + batched * groups * windows * CAPTURED_STEP_BYTES


# What an engine loads after the batched lanes and needs to serve, measured on an H100 80GB with the
# full-size model (twenty-second run, docs/benchmarks/h100-2026-12-05-run22.json): the single-stream
# encoder slots 1.2-2.3 GB, the vocoder's graphs 1.2, the fused LLM step 1.8-2.4, a saved voice's flow
# prefix 1.5, and the helper sessions and streams made while serving (each CUDA session ~155 MB: its
# cuBLAS handle and workspace). With 16 lanes and 12.8 GB left it served; the batched encoder windows
# (graph_encoder_batch) took 9.5 GB more for 16 streams, and with 3.8 GB left the first requests ran out
# of memory creating a cuBLAS handle; the batched vocoder lengths (graph_vocoder_batch) took 1.9 GB more
# than the single-stream ones. Counted in lanes (9.0, 9.5 and 1.9 GB against the fused fp16 lane's
# 2.64 GB) so that a smaller model, whose stages are smaller too, is not held to the full size's bytes.
LATER_STAGES_LANES = 3.4
ENCODER_BATCH_LANES = 3.6
VOCODER_BATCH_LANES = 0.7
# A stream whose chunks outgrow the lanes' cached frames (a long utterance) moves to the dynamic estimator
# graph: its caches grow by doubling, in the dynamic graph's precision (fp32: 4 lanes at twice a lane's
# 1,024 frames), with the old and new buffers held during a growth, in onnxruntime's arena. On the H100 of
# the twenty-seventh run (docs/benchmarks/h100-2026-12-07-run27.json), 16 lanes without overflow slots left
# 12.2 GB and the bench's long utterance ran out of memory; with 21.8 GB or more left it served (the
# twenty-third to twenty-seventh runs, 80-90 moves each). One such stream is counted: 6 lanes, 15.8 GB.
MOVED_STREAM_LANES = 6.0


def batch_lanes(batch_sizes: Sequence[int], per_lane_bytes: int, total_bytes: int, free_bytes: int,
                fraction: float = BATCH_LANE_FRACTION, groups: int = 0, windows: int = 0,
                later_bytes: int = 0) -> int:
    """The lanes (streams) of the batched estimator graphs on a GPU: the largest exported batch
    size whose lanes (`per_lane_bytes` of caches each) fit in `fraction` of `total_bytes`, and whose
    lanes with their captures and the graphs' sessions (`groups` x `windows` graphs a lane and batch
    size; 0: not counted) fit in FREE_FRACTION of `free_bytes` and, with `later_bytes` (what the engine
    loads after them and needs to serve), in `free_bytes` (a batch of 2..lanes streams pads to
    an exported size, so the lanes are one); 1 where only one fits, 0 where none does."""
    sizes = sorted(batch_sizes)
    free = max(free_bytes, 0)
    for lanes in reversed(sizes):
        caches = lanes * per_lane_bytes
        held = caches + lanes * step_captures_bytes(groups, windows) + batch_flow_reserve(sizes, lanes, groups, windows)
        if caches <= total_bytes * fraction and held <= free * FREE_FRACTION and held + later_bytes <= free:
            return lanes
    return 0


def device_total_bytes(device_id: int) -> int:
    """The GPU's memory as the driver reports it (0: not found)."""
    from cosyedge_models.backends.gpu_probe import probe_gpu

    for dev in probe_gpu().devices:
        if dev.index == device_id:
            return dev.total_memory_bytes
    return 0


def source_cache(cache: np.ndarray | None) -> np.ndarray | None:
    """The vocoder's source cache as the fixed-length graphs take it: None for none or empty."""
    if cache is None or cache.shape[2] == 0:
        return None
    return cache


def vocoder_length(cache_lens: Mapping[int, int], mel_shape: Sequence[int], cache: np.ndarray | None) -> int | None:
    """The fixed-length vocoder graph (its mel frames) for a chunk, or None: `cache_lens` maps
    each graph's mel frames to its source-cache length; batch 1, an exported length, and a
    source cache (after `source_cache`) of none or that length."""
    if mel_shape[0] != 1 or int(mel_shape[2]) not in cache_lens:
        return None
    frames = int(mel_shape[2])
    if cache is not None and tuple(cache.shape) != (1, 1, cache_lens[frames]):
        return None
    return frames


SlotT = TypeVar("SlotT")
ResultT = TypeVar("ResultT")


class SlotPool(Generic[SlotT]):
    """The request slots of a fixed-shape runtime (the estimator's or the encoder's, on
    onnxruntime or TensorRT): made and captured at load, borrowed for a request's life,
    given back at close; and its counters. Thread-safe: request threads borrow, the graph
    thread counts replays."""

    def __init__(self, max_slots: int, thread: GraphThread) -> None:
        if max_slots < 0:  # 0: the sessions only (the batched lanes hold every stream: graph_flow_overflow_slots)
            raise ValueError(f"max_slots must be >= 0, got {max_slots}")
        self.thread = thread  # where every capture and replay runs
        self.max_slots = max_slots
        self._slots: list[SlotT] = []
        self._free: list[SlotT] = []
        self._lock = threading.Lock()
        self.replays = 0  # calls served on the fixed shapes (tests, logs); counted on the graph thread
        self.moves = 0  # caches that left the fixed shapes for the dynamic path (tests, logs)
        self.disabled: str | None = None  # set when a capture or a replay failed: the dynamic path from then on

    @property
    def slot_count(self) -> int:
        with self._lock:
            return len(self._slots)

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def register(self, slot: SlotT) -> None:
        """A new slot, tracked (close() returns it) and free; slot 0 is handed out first."""
        with self._lock:
            self._slots.append(slot)
            self._free.insert(0, slot)

    def all_slots(self) -> list[SlotT]:
        with self._lock:
            return list(self._slots)

    def take_slot(self) -> SlotT | None:
        """A free slot, or None: the request then takes the dynamic path."""
        with self._lock:
            return self._free.pop() if self._free else None

    def release(self, slot: SlotT) -> None:
        with self._lock:
            self._free.append(slot)

    def note_move(self) -> None:
        with self._lock:
            self.moves += 1

    def replay(self, work: Callable[[], ResultT], what: str) -> ResultT | None:
        """`work` (a call's replay) on the graph thread; None when it raised a SynthesisError
        (e.g. a capture the runtime refuses): the pool is then disabled, once and logged, and
        the caller goes on on the dynamic path (nothing was committed)."""
        return self.guarded(functools.partial(self.thread.call, work, label=what), what)

    def guarded(self, work: Callable[[], ResultT], what: str) -> ResultT | None:
        """`work` here; None, the pool disabled (once, logged), when it raised a SynthesisError."""
        try:
            return work()
        except GraphThreadClosed:
            raise
        except SynthesisError as exc:
            self.disabled = str(exc)[:500]
            log.warning("%s disabled, the dynamic path takes over: %s", what, exc)
            return None

    def drop_slots(self) -> list[SlotT]:
        """Every slot, forgotten (the runtime frees what they hold)."""
        with self._lock:
            slots, self._slots, self._free = self._slots, [], []
        return slots


class HasLength(Protocol):
    @property
    def length(self) -> int: ...


MovedT = TypeVar("MovedT", bound=HasLength)


class SlotBorrower(Generic[SlotT, MovedT]):
    """A request's cache on a pooled slot while its calls fit the fixed shapes, then (once
    moved) on `_moved`, a cache over the dynamic path."""

    def __init__(self, slot: SlotT) -> None:
        self._slot: SlotT | None = slot
        self._moved: MovedT | None = None
        self._length = 0  # committed rows on the slot
        self._closed = False

    @property
    def length(self) -> int:
        return self._moved.length if self._moved is not None else self._length

    @property
    def on_graph(self) -> bool:
        """True while the calls replay the fixed-shape graphs."""
        return self._slot is not None

