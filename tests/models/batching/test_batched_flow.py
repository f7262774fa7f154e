"""The batched estimator runtime (models/batching/batched_flow.py) over the bundle's
flow_estimator_batch_b<B>_w<W> graphs, against the single-stream fixed-shape runtime
(ort_static_flow.py's StaticStepCache) running each stream alone: streams join and
leave, a slot is reused, batch sizes and windows change from call to call, a slot of
the batch sits idle, and a stream attends to a bounded left context. On the CPU
without capture (as the single-stream runtime's tests)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cosyedge_build.tools.device_lane_replay import window_feeds as _feeds  # one stream's window
from cosyedge_models.backends.factory import create_backend
from cosyedge_models.backends.flow_cache import StepCacheSpec
from cosyedge_models.backends.graph_thread import GraphThread
from cosyedge_models.backends.ort_cache import DeviceCopier
from cosyedge_models.backends.ort_static_flow import StaticFlowGraphs, StaticStepCache
from cosyedge_models.batching.batched_flow import BatchFlowGraphs, SlotCall, batch_flow_sessions
from cosyedge_models.bundle.loader import STATIC_FLOW_PREFIX
from cosyedge_models.errors import SynthesisError

from tests.conftest import BATCH_FLOW_SIZES, STATIC_FLOW_CACHE, STATIC_FLOW_WINDOWS
from tests.models.flow_streams import flow_sessions


def test_batched_slots_equal_each_stream_alone(static_flow_bundle: Path) -> None:
    sessions, bundle = flow_sessions(static_flow_bundle, "cpu", STATIC_FLOW_PREFIX)
    backend = create_backend("ort")
    batched = batch_flow_sessions(bundle, lambda name, path: backend.load(name, path, threads=1))
    assert sorted(batched) == [(b, w) for b in BATCH_FLOW_SIZES for w in STATIC_FLOW_WINDOWS]
    statics = [s for n, s in sessions.items() if n.startswith(STATIC_FLOW_PREFIX)]
    copier = DeviceCopier("cpu")
    thread = GraphThread().start()
    single = StaticFlowGraphs(statics, ("cpu", 0), copier, max_slots=4, thread=thread)
    single.warm_up()
    with pytest.raises(ValueError, match=r"lanes \(3\) must be one of the batch sizes \[1, 2\]"):
        BatchFlowGraphs(batched, ("cpu", 0), copier, lanes=3)  # a batch of 3 would pad past its group
    graphs = BatchFlowGraphs(batched, ("cpu", 0), copier)
    graphs.warm_up()
    assert graphs.slots == 2 and graphs.cache_frames == STATIC_FLOW_CACHE
    assert graphs.windows == list(STATIC_FLOW_WINDOWS)
    spec = StepCacheSpec(single.row, single.conv, np.dtype(np.float32))
    chunk = int(bundle.manifest["stages"][f"{STATIC_FLOW_PREFIX}{STATIC_FLOW_WINDOWS[0]}"]["chunk_frames"])
    channels = int(statics[0].input_shapes["x"][1])
    rng = np.random.default_rng(9)
    alone: dict[int, StaticStepCache] = {}  # slot -> the stream's single-stream cache

    def join(slot: int) -> None:
        if slot in alone:
            alone[slot].close()
        cache = single(sessions["flow_estimator"], spec)
        assert isinstance(cache, StaticStepCache)
        alone[slot] = cache
        graphs.reset(slot)

    def call(windows: dict[int, tuple[int, int, int]]) -> None:
        """slot -> (frames, commit, first)."""
        calls = [SlotCall(slot, _feeds(rng, channels, frames), commit, first)
                 for slot, (frames, commit, first) in windows.items()]
        before = {s: graphs.read_slot(s) for s in range(graphs.slots) if s not in windows}
        outs = graphs.run(calls)
        for c, out in zip(calls, outs, strict=True):
            cache = alone[c.slot]
            # the single-stream runtime's bounded left context: its visible frames start at `first`
            cache.spec = StepCacheSpec(spec.row, spec.conv, spec.dtype, visible=cache.length - c.first)
            ref = cache.run(c.feeds, c.commit)
            np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * float(np.abs(ref).max()))
            assert graphs.lengths[c.slot] == cache.length
        for s, (kv, conv) in before.items():  # idle slots: cache and history untouched
            kv_now, conv_now = graphs.read_slot(s)
            np.testing.assert_array_equal(kv_now, kv)
            np.testing.assert_array_equal(conv_now, conv)

    join(0)
    call({0: (STATIC_FLOW_WINDOWS[0], chunk, 0)})  # batch 1, the small window
    join(1)
    call({0: (100, chunk, 0), 1: (40, 0, 0)})  # batch 2, the large window; 1 commits nothing
    call({1: (STATIC_FLOW_WINDOWS[0], chunk, 0)})  # batch 2 with slot 0 idle
    call({0: (60, chunk, chunk), 1: (STATIC_FLOW_WINDOWS[0], chunk, 0)})  # slot 0: bounded left context
    join(0)  # stream 0 leaves, a new one takes its slot
    call({0: (STATIC_FLOW_WINDOWS[0], chunk, 0), 1: (30, 0, 0)})
    call({0: (STATIC_FLOW_WINDOWS[1], 2 * chunk, 0)})
    # windows of both buckets in one replay (flow_order: one Euler step shares, whatever the windows):
    # the small one committing, padded into the large window
    call({0: (STATIC_FLOW_WINDOWS[0], chunk, 0), 1: (STATIC_FLOW_WINDOWS[0] + 30, chunk, 0)})
    assert graphs.replays == 7 and graphs.lengths == [4 * chunk, 3 * chunk]

    # a window beyond the largest, or a cache that would outgrow its frames, is refused (the caller
    # moves that stream to the dynamic graph)
    assert not graphs.fits(0, STATIC_FLOW_WINDOWS[-1] + 1, 0)
    assert not graphs.fits(0, 10, STATIC_FLOW_CACHE)
    with pytest.raises(SynthesisError, match="does not fit"):
        graphs.run([SlotCall(0, _feeds(rng, channels, STATIC_FLOW_WINDOWS[-1] + 1), 0)])
    with pytest.raises(ValueError, match="distinct slots"):
        graphs.run([SlotCall(0, _feeds(rng, channels, 10), 0), SlotCall(0, _feeds(rng, channels, 10), 0)])
    for cache in alone.values():
        cache.close()
    thread.close()
    for s in [*sessions.values(), *batched.values()]:
        s.close()
