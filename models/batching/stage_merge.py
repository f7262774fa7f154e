"""How calls to one stage graph from different requests merge into one run
and split back (models/batching/stage_batcher.py queues them): every input is
concatenated along its batch axis, time axes are right-padded with zeros to
the longest call where the graph allows it, and the outputs are sliced back
per call. A call that cannot merge (its `key` is None) runs alone.

Which calls merge, per stage (the graph I/O is documented in
edge_build/export/flow_estimator.py and hift.py):

* flow_estimator: calls with the same cache length S, the same commit
  length R and the same `outputs`; T is padded with mask 0. The attention
  masks keys where mask == 0 and every convolution is causal and multiplied by
  the mask, so a valid frame never sees the padding: each request's rows are
  what they are alone (up to float reassociation in the bigger GEMMs). Cached
  keys are visible to every query of their row, so calls with different S
  cannot share a run (offline calls and first streaming windows have S = 0;
  later streaming windows merge only when requests are in lockstep).
  Estimators that are not chunk-causal (multi-level U-Nets, `stream_cache`
  false) have a non-causal strided downsample: only equal T merge there.
* hift_source / hift_decoder: only calls with equal mel length: HiFT's
  convolutions are not causal, so right padding would change the tail.
  The source noise is an input drawn on the request's thread, so it stays
  per request.

On the trt backend a merged call must also fit one of the engine's
optimization profiles (e.g. the estimator's offline profile takes up to 4
requests, its streaming profile only one): `profile_fits`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from cosyedge_models.backends.profiles import ProfileShapes

log = logging.getLogger(__name__)

Feeds = Mapping[str, np.ndarray]

# A call joins a merged run only if its length is at least this fraction of
# the run's padded length: padding is computed work (at full size on the CPU
# a merged run of 4 costs ~0.8x four single runs, so padding much beyond 25%
# loses more than merging wins). Calls left out run in the next batch.
MIN_FILL = 0.75


@dataclass(frozen=True)
class Axes:
    batch: int
    time: int | None = None  # right-padded with zeros to the longest call


class AxisMerger:
    """Merges calls whose inputs agree in every dimension but the batch axis
    (and the padded time axis). `inputs` maps every graph input to its axes,
    or None for an input that is shared (equal in every call: its shape is
    part of the key, its value is taken from the first call). `time_ref` is
    the input whose time axis gives each call's own length for the outputs."""

    def __init__(self, inputs: Mapping[str, Axes | None], outputs: Mapping[str, Axes],
                 time_ref: str | None = None, min_fill: float = MIN_FILL) -> None:
        self.inputs = dict(inputs)
        self.outputs = dict(outputs)
        self.time_ref = time_ref
        self.min_fill = min_fill

    def key(self, feeds: Feeds, outputs: Sequence[str] | None) -> Hashable | None:
        """Calls with equal keys merge; None: this call runs alone."""
        if set(feeds) != set(self.inputs) or any(o not in self.outputs for o in outputs or ()):
            return None
        parts: list[Hashable] = [None if outputs is None else tuple(outputs)]
        for name in sorted(feeds):
            a, ax = feeds[name], self.inputs[name]
            drop = () if ax is None else (ax.batch, ax.time)
            parts.append((name, a.dtype.str, tuple(d for i, d in enumerate(a.shape) if i not in drop)))
        return tuple(parts)

    def length(self, feeds: Feeds) -> int | None:
        """A call's own length along the padded time axis (None: not padded)."""
        if self.time_ref is None:
            return None
        ax = self.inputs[self.time_ref]
        return None if ax is None or ax.time is None else int(feeds[self.time_ref].shape[ax.time])

    def select(self, calls: Sequence[Feeds]) -> list[int]:
        """Indices of the calls (in the given order, the first always) that
        share a run without padding any of them below `min_fill`."""
        lengths = [self.length(c) for c in calls]
        known = [n for n in lengths if n is not None]
        if len(known) < len(lengths):
            return list(range(len(calls)))
        chosen: list[int] = []
        for i, n in enumerate(known):
            with_it = [known[j] for j in chosen] + [n]
            if min(with_it) >= self.min_fill * max(with_it):
                chosen.append(i)
        return chosen

    def rows(self, feeds: Feeds) -> int:
        """Batch rows of one call (the first batched input's)."""
        name, ax = next((n, a) for n, a in self.inputs.items() if a is not None)
        return int(feeds[name].shape[ax.batch])

    def merged_shapes(self, calls: Sequence[Feeds]) -> dict[str, tuple[int, ...]]:
        """Input shapes of the merged run (without building it)."""
        out = {}
        for name, ax in self.inputs.items():
            shape = list(calls[0][name].shape)
            if ax is not None:
                shape[ax.batch] = sum(int(c[name].shape[ax.batch]) for c in calls)
                if ax.time is not None:
                    shape[ax.time] = max(int(c[name].shape[ax.time]) for c in calls)
            out[name] = tuple(shape)
        return out

    def merge(self, calls: Sequence[Feeds]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for name, ax in self.inputs.items():
            if ax is None:
                out[name] = calls[0][name]
                continue
            parts = [c[name] for c in calls]
            if ax.time is not None:
                parts = [_pad_right(p, ax.time, max(q.shape[ax.time] for q in parts)) for p in parts]
            out[name] = np.concatenate(parts, axis=ax.batch)
        return out

    def split(self, merged: Mapping[str, np.ndarray], calls: Sequence[Feeds]) -> list[dict[str, np.ndarray]]:
        results: list[dict[str, np.ndarray]] = [{} for _ in calls]
        rows = [self.rows(c) for c in calls]
        for name, array in merged.items():
            ax = self.outputs[name]
            start = 0
            for i, call in enumerate(calls):
                index: list[slice] = [slice(None)] * array.ndim
                index[ax.batch] = slice(start, start + rows[i])
                if ax.time is not None and self.time_ref is not None:
                    ref_ax = self.inputs[self.time_ref]
                    assert ref_ax is not None and ref_ax.time is not None
                    index[ax.time] = slice(0, call[self.time_ref].shape[ref_ax.time])
                # A copy: the caller keeps parts of it (caches) and feeds them to later runs.
                results[i][name] = np.ascontiguousarray(array[tuple(index)])
                start += rows[i]
        return results


def _pad_right(a: np.ndarray, axis: int, length: int) -> np.ndarray:
    if a.shape[axis] == length:
        return a
    width = [(0, 0)] * a.ndim
    width[axis] = (0, length - a.shape[axis])
    return np.pad(a, width)


def estimator_merger(pad_time: bool = True) -> AxisMerger:
    """The flow estimator (CFG rows are the batch: 2 per call)."""
    window = Axes(0, 2 if pad_time else None)
    return AxisMerger(
        inputs={"x": window, "mask": window, "mu": window, "cond": window, "t": Axes(0), "spks": Axes(0),
                "chunk_frames": Axes(0), "att_cache": Axes(3), "conv_cache": Axes(1), "commit": None},
        outputs={"dphi_dt": window, "att_cache_new": Axes(3), "conv_cache_new": Axes(1)},
        time_ref="x" if pad_time else None,
    )


def hift_source_merger() -> AxisMerger:
    return AxisMerger(inputs={"mel": Axes(0), "noise": Axes(0)}, outputs={"source": Axes(0)})


def hift_decoder_merger() -> AxisMerger:
    return AxisMerger(inputs={"mel": Axes(0), "source": Axes(0)}, outputs={"audio": Axes(0)})


def profile_fits(profiles: Sequence[ProfileShapes]) -> Callable[[Mapping[str, tuple[int, ...]]], bool]:
    """Whether merged input shapes fit one TensorRT optimization profile."""
    def fits(shapes: Mapping[str, tuple[int, ...]]) -> bool:
        return any(all(name in prof and prof[name].contains(shape) for name, shape in shapes.items())
                   for prof in profiles)
    return fits
