"""The fixed-shape stages' pure logic (models/backends/fixed_shapes.py), on
the CPU: settings, buckets, padding, masks, the rows a commit or a trim
copies, slots that fit, the vocoder's choice of graph. And the composition
the TensorRT runtime (tensorrt/static_flow.py) makes of them, replayed here over
the fixed-shape ONNX graphs on onnxruntime's CPU provider with a host array
as the slot: a stream through it gives the dynamic graph's mel, through the
cache's growth, a move to the dynamic graph and bounded-context trims."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
from cosyedge_models.backends.factory import create_backend
from cosyedge_models.backends.fixed_shapes import (
    AUTO_DEVICE_FRACTION,
    RowCopy,
    bucket,
    commit_copy,
    commit_index,
    fixed_shape_names,
    fixed_shapes_wanted,
    flow_request_bytes,
    pad_window,
    prefix_fits,
    slots_that_fit,
    source_cache,
    stays_fixed,
    trim_copy,
    valid_mask,
    visible_first,
    vocoder_length,
)
from cosyedge_models.backends.flow_cache import HostStepCache, PrefixRows, StepCache, StepCacheSpec, trim_due
from cosyedge_models.backends.ort import OrtSession
from cosyedge_models.bundle.loader import STATIC_FLOW_PREFIX, STATIC_VOCODER_PREFIX, load_bundle
from cosyedge_models.errors import BundleError
from cosyedge_models.synthesis.flow import FlowDecoder, FlowPrompt
from cosyedge_models.synthesis.streaming import ChunkSchedule

from tests.conftest import STATIC_FLOW_WINDOWS


def test_settings_turn_a_family_on() -> None:
    stages = ["flow_estimator", f"{STATIC_FLOW_PREFIX}160", f"{STATIC_FLOW_PREFIX}64", f"{STATIC_VOCODER_PREFIX}58"]
    names = fixed_shape_names(stages, STATIC_FLOW_PREFIX)
    assert names == [f"{STATIC_FLOW_PREFIX}160", f"{STATIC_FLOW_PREFIX}64"]
    root = Path("/b")
    assert fixed_shapes_wanted(names, None, "trt", root, "x")
    assert fixed_shapes_wanted(names, None, "ort-cuda", root, "x")
    assert not fixed_shapes_wanted(names, None, "ort", root, "x")  # auto: GPUs only
    assert fixed_shapes_wanted(names, True, "ort", root, "x")
    assert not fixed_shapes_wanted(names, False, "trt", root, "x")
    assert not fixed_shapes_wanted([], None, "trt", root, "x")  # a bundle without them: off, no error
    with pytest.raises(BundleError, match="/b: graph_flow needs them"):
        fixed_shapes_wanted([], True, "trt", root, "graph_flow needs them")


def test_buckets_padding_masks_and_commit_index() -> None:
    assert [bucket([64, 160], n) for n in (1, 64, 65, 160, 161)] == [0, 0, 1, 1, None]
    x = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
    padded = pad_window(x, 5)
    assert padded.shape == (1, 2, 5) and padded.dtype == np.float32
    np.testing.assert_array_equal(padded[..., :3], x)
    assert not padded[..., 3:].any()
    assert visible_first(10, -1) == 0 and visible_first(10, 4) == 6 and visible_first(3, 4) == 0
    np.testing.assert_array_equal(valid_mask(6, 2, 4), [0, 0, 1, 1, 0, 0])
    np.testing.assert_array_equal(commit_index(7, 2), [7, 8])
    assert commit_index(0, 3).dtype == np.int64


def test_what_stays_on_the_fixed_shapes() -> None:
    assert stays_fixed(0, 100, 50, 150, False)
    assert not stays_fixed(0, 100, 51, 150, False)  # the cache would overflow
    assert not stays_fixed(None, 0, 10, 150, False)  # no bucket holds the window
    assert not stays_fixed(0, 0, 10, 150, True)  # disabled
    assert prefix_fits(96, [64, 160], 160) and not prefix_fits(97, [64, 160], 160)


def test_rows_a_commit_and_a_trim_copy() -> None:
    assert commit_copy(30, 0) is None
    assert commit_copy(30, 20) == RowCopy(30, 0, 20) and RowCopy(30, 0, 20).nbytes(8) == 160
    for length, keep, cap in ((100, 20, 160), (80, 20, 160), (41, 20, 40), (10, 20, 40), (50, -1, 40)):
        copy = trim_copy(length, keep, cap)
        assert (copy is not None) == (keep >= 0 and trim_due(length, keep, cap))
        if copy is not None:  # the last `keep` rows to the front, never overlapping
            assert copy == RowCopy(0, length - keep, keep) and copy.src >= copy.frames


def test_slots_that_fit_and_request_bytes() -> None:
    gb = 10**9
    assert slots_that_fit(8, int(4.7 * gb), 139 * gb) == int(139 * gb * AUTO_DEVICE_FRACTION) // int(4.7 * gb)
    assert slots_that_fit(8, int(4.7 * gb), 8 * gb) == 0
    assert slots_that_fit(3, 0, 0) == 3
    assert flow_request_bytes((320, 2, 2, 2, 4, 8), (3, 2, 16, 2), 10) == 10 * 4 * (320 * 256 + 192)


def test_which_vocoder_graph_a_chunk_takes() -> None:
    lens = {58: 480, 50: 480}
    empty = np.zeros((1, 1, 0), np.float32)
    cache = np.zeros((1, 1, 480), np.float32)
    assert source_cache(None) is None and source_cache(empty) is None and source_cache(cache) is cache
    assert vocoder_length(lens, (1, 80, 58), None) == 58
    assert vocoder_length(lens, (1, 80, 50), cache) == 50
    assert vocoder_length(lens, (1, 80, 51), None) is None  # no graph of that length
    assert vocoder_length(lens, (2, 80, 58), None) is None  # batches go dynamic
    assert vocoder_length(lens, (1, 80, 58), np.zeros((1, 1, 100), np.float32)) is None


class HostSlotCache:
    """TrtStaticStepCache's steps with a host array as the slot: fixed_shapes decides, the
    fixed-shape graph runs on onnxruntime's CPU provider, host copies stand for device ones."""

    def __init__(self, statics: list[OrtSession], dynamic: OrtSession, spec: StepCacheSpec,
                 room: int | None = None) -> None:
        self.spec = spec
        self.statics = sorted(statics, key=lambda s: int(s.input_shapes["x"][2]))
        self.windows = [int(s.input_shapes["x"][2]) for s in self.statics]
        self.frames = int(self.statics[0].input_shapes["att_cache"][0])
        self.history = int(self.statics[0].input_shapes["commit_index"][0])
        self.room = self.frames if room is None else room  # a smaller room makes the stream move sooner
        self.kv = np.zeros((self.frames, *spec.row), np.float32)
        self.conv = np.zeros(spec.conv, np.float32)
        self.length = 0
        self.dynamic = dynamic
        self.moved: HostStepCache | None = None
        self.static_calls = 0
        self.moves = 0  # kept after close (which drops the moved cache)

    def preload(self, rows: PrefixRows, conv: np.ndarray) -> None:
        assert prefix_fits(rows.frames, self.windows, self.frames)
        self.kv[: rows.frames] = rows.host
        self.conv = conv.copy()
        self.length = rows.frames

    def _move(self) -> HostStepCache:
        moved = HostStepCache(self.dynamic, self.spec)
        first = visible_first(self.length, self.spec.visible)
        moved.preload(PrefixRows(self.kv[first: self.length].copy()), self.conv.copy())
        self.moved = moved
        self.moves += 1
        return moved

    def run(self, feeds: Mapping[str, np.ndarray], commit: int) -> np.ndarray:
        w = bucket(self.windows, int(feeds["x"].shape[2]))
        if self.moved is None and not stays_fixed(w, self.length, commit, self.room, False):
            self._move()
        if self.moved is not None:
            return self.moved.run(feeds, commit)
        assert w is not None
        window, frames = self.windows[w], int(feeds["x"].shape[2])
        out = self.statics[w].run({
            **{n: pad_window(feeds[n], window) for n in ("x", "mask", "mu", "cond")},
            "t": feeds["t"], "spks": feeds["spks"], "att_cache": self.kv, "conv_cache": self.conv,
            "cache_valid": valid_mask(self.frames, visible_first(self.length, self.spec.visible), self.length),
            "commit_index": commit_index(commit, self.history)})
        copy = commit_copy(self.length, commit)
        if copy is not None:
            self.kv[copy.dst: copy.dst + copy.frames] = out["att_window"][copy.src: copy.src + copy.frames]
            self.conv = out["conv_cache_new"]
        self.length += commit
        self.static_calls += 1
        return out["dphi_dt"][:, :, :frames]

    def trim(self) -> None:
        if self.moved is not None:
            self.moved.trim()
            return
        copy = trim_copy(self.length, self.spec.visible, self.frames)
        if copy is not None:
            self.kv[copy.dst: copy.dst + copy.frames] = self.kv[copy.src: copy.src + copy.frames].copy()
            self.length = copy.frames

    def nbytes(self) -> int:
        return 0

    def close(self) -> None:
        self.moved = None


@pytest.mark.parametrize(("n_tokens", "left", "room"), [(60, -1, None), (120, -1, 100), (190, 2, None)],
                         ids=["fits", "moves", "left-2-trims"])
def test_the_trt_slot_logic_gives_the_dynamic_graphs_mel(static_flow_bundle: Path, n_tokens: int, left: int,
                                                          room: int | None) -> None:
    bundle = load_bundle(static_flow_bundle)
    backend = create_backend("ort")
    load = {n: backend.load(n, bundle.stages[n].path, threads=1)
            for n in ("flow_encoder", "flow_estimator", *fixed_shape_names(bundle.stages, STATIC_FLOW_PREFIX))}
    statics = [s for n, s in load.items() if n.startswith(STATIC_FLOW_PREFIX) and isinstance(s, OrtSession)]
    assert sorted(int(s.input_shapes["x"][2]) for s in statics) == sorted(STATIC_FLOW_WINDOWS)
    est = load["flow_estimator"]
    assert isinstance(est, OrtSession)
    made: list[HostSlotCache] = []

    def slot_cache(session: object, spec: StepCacheSpec) -> StepCache:
        made.append(HostSlotCache(statics, est, spec, room))
        return made[-1]

    prompt = FlowPrompt(tokens=np.arange(12, dtype=np.int64) % 50,
                        feat=np.random.default_rng(1).standard_normal((24, bundle.mel_bins)).astype(np.float32),
                        embedding=np.random.default_rng(2).standard_normal(192).astype(np.float32))
    toks = np.random.default_rng(3).integers(0, bundle.llm.speech_token_size, n_tokens)

    def stream(factory: object) -> np.ndarray:
        dec = FlowDecoder(bundle, load["flow_encoder"], est, factory)  # type: ignore[arg-type]
        look = dec.config.pre_lookahead_len
        schedule = ChunkSchedule(25, look, prompt_tokens=len(prompt.tokens))
        mels = []
        with dec.stream(prompt, "cached", left) as s:
            while (chunk := schedule.next_chunk(len(toks))) is not None:
                mels.append(s.push(toks[: chunk.end + look]))
            mels.append(s.finish(toks))
        return np.concatenate(mels, axis=2)

    dynamic = stream(lambda session, spec: HostStepCache(session, spec))
    fixed = stream(slot_cache)
    np.testing.assert_allclose(fixed, dynamic, rtol=0, atol=1e-5)
    assert made and all(c.static_calls > 0 for c in made)
    moved = any(c.moves for c in made)
    assert moved == (room is not None)  # a room of 100 frames is outgrown mid-stream: the move
    for s in load.values():
        s.close()
