"""The fixed-shape stages' pure logic (models/backends/fixed_shapes.py), on
the CPU: settings, buckets, padding, masks, the rows a commit or a trim
copies, slots that fit, the vocoder's choice of graph. And the composition
the TensorRT runtime (tensorrt/static_flow.py) makes of them, replayed here over
the fixed-shape ONNX graphs on onnxruntime's CPU provider with a host array
as the slot: a stream through it gives the dynamic graph's mel, through the
cache's growth, a move to the dynamic graph and bounded-context trims."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cosyedge_models.backends.fixed_shapes import (
    AUTO_DEVICE_FRACTION,
    CAPTURED_STEP_BYTES,
    ENCODER_BATCH_LANES,
    FREE_FRACTION,
    LATER_STAGES_LANES,
    SESSION_DEVICE_BYTES,
    BatchPlan,
    RowCopy,
    batch_flow_reserve,
    batch_lanes,
    bucket,
    commit_copy,
    commit_index,
    fixed_shape_names,
    fixed_shapes_wanted,
    flow_request_bytes,
    pad_window,
    plan_batches,
    prefix_fits,
    slots_that_fit,
    source_cache,
    stays_fixed,
    step_captures_bytes,
    trim_copy,
    valid_mask,
    visible_first,
    vocoder_length,
)
from cosyedge_models.backends.flow_cache import trim_due
from cosyedge_models.bundle.loader import STATIC_FLOW_PREFIX, STATIC_VOCODER_PREFIX
from cosyedge_models.errors import BundleError


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


def test_batch_lanes_are_an_exported_size_that_fits_total_and_free_memory() -> None:
    gb = 10**9
    lane = int(7.6 * gb)  # the full-size estimator's lane over 10 Euler steps (H200 run, 2026-12-03)
    # half of an idle H200: eight lanes
    assert batch_lanes([1, 8], lane, 143 * gb, 140 * gb) == 8
    # 70 GB held by another process: the free memory bounds it, and without a size between 1 and 8, off
    assert batch_lanes([1, 8], lane, 143 * gb, 73 * gb) == 1
    assert batch_lanes([1, 2, 4, 8], lane, 143 * gb, 73 * gb) == 4
    assert batch_lanes([1, 2, 4, 8], lane, 8 * gb, 8 * gb) == 0  # an 8 GB board: not one lane
    assert batch_lanes([1, 2, 4, 8, 16], 1 << 20, 8 * gb, 4 * gb) == 16  # the tiny model's lanes fit anywhere
    assert batch_lanes([1, 2], lane, 143 * gb, -1) == 0  # a driver that reports more used than total


def test_batch_lanes_count_their_captures_and_sessions_in_the_free_memory() -> None:
    """The H100 80GB of 2026-12-05: 16 fused fp16 lanes (2.64 GB each over 10 Euler steps, windows 64
    and 128) fit half of its 85.5 GB and 80% of ~55 GB free by their caches alone (42.3 GB), and the
    engine ran out of memory capturing after them; with their captures (10 x 2 graphs a lane) and the
    six sessions they are 8."""
    gb = 10**9
    lane, total, free = int(2.64 * gb), int(85.5 * gb), int(55 * gb)
    assert batch_lanes([1, 8, 16], lane, total, free) == 16  # caches alone: the old rule's answer
    assert batch_lanes([1, 8, 16], lane, total, free, groups=10, windows=2) == 8
    held = 16 * (lane + step_captures_bytes(10, 2)) + batch_flow_reserve([1, 8, 16], 16, 10, 2)
    assert held > free * FREE_FRACTION >= 16 * lane
    # an idle H200 (150.7 GB): still 16
    assert batch_lanes([1, 8, 16], lane, int(150.7 * gb), int(130 * gb), groups=10, windows=2) == 16
    # the reserve: a session per (batch size, window) and the batch-8 graph's captures (16 is above 8 lanes)
    assert batch_flow_reserve([1, 8, 16], 8, 10, 2) == 6 * SESSION_DEVICE_BYTES + 20 * CAPTURED_STEP_BYTES


def test_plan_batches_fits_slots_and_captured_sizes() -> None:
    # budget 100 x 0.5 = 50; 4 slots: 5 + 4 x 10 + (1 + 2 + 4) = 52 > 50; 3 slots: 5 + 30 + 1 + 2 = 38
    costs = {1: 1, 2: 2, 4: 4, 8: 8}
    assert plan_batches(16, 10, 100, costs, fixed_bytes=5, fraction=0.5) == BatchPlan(3, (1, 2), 38)
    # without the batch sizes' own cost 4 slots would fit (45): the captured sizes count
    assert plan_batches(16, 10, 100, fixed_bytes=5, fraction=0.5) == BatchPlan(4, (1, 2, 4), 45)
    assert plan_batches(2, 10, 100, costs, fraction=0.5) == BatchPlan(2, (1, 2), 23)  # never more than asked
    assert plan_batches(8, 60, 100, fraction=0.5) == BatchPlan(0, (), 0)  # an 8 GB board at full size: none
    with pytest.raises(ValueError, match="ascending from 1"):
        plan_batches(4, 10, 100, sizes=(2, 4))


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


# The slot logic itself (TrtStaticStepCache over these decisions: fits, moves, trims) runs on the
# real class under the TensorRT emulator: tests/models/backends/test_trt_static.py.


def test_batch_lanes_leave_room_for_the_stages_loaded_after_them() -> None:
    """The H100 80GB of the twenty-second run: 16 fused fp16 lanes fit by their own rule (21.7 GB in use
    before them), then the batched encoder windows, the vocoder, the fused LLM step and a voice left 3.8 GB
    and serving ran out of memory; without the batched encoder windows 12.8 GB were left and it served."""
    gb = 10**9
    lane, total, free = int(2.64 * gb), int(85.0 * gb), int(63.3 * gb)
    rule = {"groups": 10, "windows": 2}
    assert batch_lanes([1, 8, 16], lane, total, free, **rule) == 16  # no later stages counted: the old answer
    later = int(lane * LATER_STAGES_LANES)
    with_encoder = int(lane * (LATER_STAGES_LANES + ENCODER_BATCH_LANES))
    assert batch_lanes([1, 8, 16], lane, total, free, **rule, later_bytes=later) == 16  # what served
    assert batch_lanes([1, 8, 16], lane, total, free, **rule, later_bytes=with_encoder) == 8
    # an idle H200 (150.1 GB, 21.7 in use): 16 either way, as the twenty-first run served them
    assert batch_lanes([1, 8, 16], lane, int(150.1 * gb), int(128.4 * gb), **rule, later_bytes=with_encoder) == 16
    # the tiny model's lanes (a MB each) and their later stages fit anywhere
    assert batch_lanes([1, 8, 16], 1 << 20, 8 * gb, 4 * gb, later_bytes=int((1 << 20) * 7)) == 16


def test_an_80gb_card_keeps_room_for_a_long_stream_moved_off_the_lanes() -> None:
    """The twenty-sixth and twenty-seventh runs' H100 (85.0 GB, fused fp16 lanes of 2.64 GB; 21.7 GB in use
    when the lanes were sized with the two single-stream overflow slots, 8.7 GB without them). With the
    batched encoder windows and vocoder lengths and no overflow slots, the stages after the lanes alone let
    16 lanes in, and the bench's long utterance, moved to the dynamic estimator graph, ran out of memory
    with 12.2 GB left: counting one moved stream gives 8. Beside the slots 8, as it loaded and served. Without
    the batched encoder windows (the plan's `b`), 16 lanes fit only without the slots."""
    from cosyedge_models.backends.fixed_shapes import (
        ENCODER_BATCH_LANES,
        LATER_STAGES_LANES,
        MOVED_STREAM_LANES,
        VOCODER_BATCH_LANES,
    )

    lane, total = int(2.64e9), int(85.0e9)
    with_slots, without = total - int(21.7e9), total - int(8.7e9)

    def lanes(free: int, later_lanes: float) -> int:
        return batch_lanes([1, 8, 16], lane, total, free, groups=10, windows=2, later_bytes=int(lane * later_lanes))

    goals = LATER_STAGES_LANES + ENCODER_BATCH_LANES + VOCODER_BATCH_LANES
    assert lanes(without, goals) == 16  # the stages alone: what loaded, and ran out of memory
    assert (lanes(with_slots, goals + MOVED_STREAM_LANES), lanes(without, goals + MOVED_STREAM_LANES)) == (8, 8)
    no_encoder = LATER_STAGES_LANES + MOVED_STREAM_LANES
    assert (lanes(with_slots, no_encoder), lanes(without, no_encoder)) == (8, 16)
    # an idle H200 (150.1 GB, 21.7 in use): the goals' configuration keeps its 16 lanes beside the slots
    assert batch_lanes([1, 8, 16], lane, int(150.1e9), int(128.4e9), groups=10, windows=2,
                       later_bytes=int(lane * (goals + MOVED_STREAM_LANES))) == 16
