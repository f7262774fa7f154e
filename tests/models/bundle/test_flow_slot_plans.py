"""The Jetson budget's fixed-shape flow slots per board (plan_batches over each board's memory),
against hand-computed counts."""

from __future__ import annotations

from cosyedge_models.backends.fixed_shapes import CAPTURED_STEP_BYTES, SESSION_DEVICE_BYTES, BatchPlan
from cosyedge_models.bundle.memory_budget import flow_slot_plans


def _meta(dtype: str) -> dict[str, object]:
    inputs = [{"name": "att_cache", "dtype": dtype, "shape": [1000, 1000, 100]},
              {"name": "conv_cache", "dtype": dtype, "shape": [1, 1]}]
    return {"flow_estimator_static_w64": {"file": "x.onnx", "inputs": inputs}}


def test_slots_per_board_follow_their_memory() -> None:
    # fp32: (1e8 + 1) elements x 4 B x 10 steps ~ 4.0e9 B of caches a slot, and its captured graphs, one a
    # window (here one) at each Euler step: 10 x 14e6 = 0.14e9 B; once, a session a window: 0.16e9 B. A
    # quarter of 7.4 / 15.3 / 30.0 / 61.3 GiB is 1.99e9 / 4.11e9 / 8.05e9 / 16.45e9 B: 0 / 0 / 1 / 3 slots
    # (the caches alone: 0 / 1 / 2 / 4; NX: 4.30e9 > 4.11e9; AGX 64 GB: 4 slots 16.72e9 > 16.45e9)
    plans = flow_slot_plans(_meta("float32"), 10)
    assert {k: p.slots for k, p in plans.items()} == {
        "orin-nano-8gb": 0, "orin-nx-16gb": 0, "agx-orin-32gb": 1, "agx-orin-64gb": 3}
    assert plans["orin-nano-8gb"] == BatchPlan(0, (), 0)
    assert plans["agx-orin-64gb"].batch_sizes == (1, 2)
    assert plans["agx-orin-32gb"].bytes == int(4e9) + 40 + 10 * CAPTURED_STEP_BYTES + SESSION_DEVICE_BYTES
    # fp16 caches: half a slot's cache bytes (2.0e9 + 0.14e9 a slot: above the Nano's 1.99e9), the captures
    # the same: NX 1 (2: 4.44e9), AGX 32 GB 3 (4: 8.72e9), AGX 64 GB 7 (8: 17.28e9)
    half = flow_slot_plans(_meta("float16"), 10)
    assert {k: p.slots for k, p in half.items()} == {
        "orin-nano-8gb": 0, "orin-nx-16gb": 1, "agx-orin-32gb": 3, "agx-orin-64gb": 7}
    # two windows: twice the captures a slot and two sessions
    two = {**_meta("float32"), "flow_estimator_static_w128": _meta("float32")["flow_estimator_static_w64"]}
    assert flow_slot_plans(two, 10)["agx-orin-32gb"].bytes == (int(4e9) + 40 + 20 * CAPTURED_STEP_BYTES
                                                               + 2 * SESSION_DEVICE_BYTES)


def test_no_fixed_shape_graphs_no_plans() -> None:
    assert flow_slot_plans({"flow_estimator": {"file": "e.onnx"}}, 10) == {}


def test_batched_lanes_per_board_beside_the_single_stream_slots() -> None:
    # a full-size lane: 10 steps x 2 rows x (2 x 56 blocks x 8 x 1,664 x 64 + 11 x 320 x 2) x 4 B = 7.63e9 B;
    # the two single-stream slots (4.0e9 B each, _meta) fit the quarter on all but the Nano (none) and
    # the NX (one); the lanes then fit min(half the GPU, 80% of the rest): Nano 3.97e9 -> 0,
    # NX min(8.2e9, 9.9e9) -> 1 (no size 2 fits), AGX 32 GB 16.1e9 -> 2, AGX 64 GB 32.9e9 -> 4
    from cosyedge_models.bundle.memory_budget import flow_lane_plans

    inputs = [{"name": f"{kv}_cache_{i}", "dtype": "float32", "shape": [2, 8, 1664, 64]}
              for i in range(56) for kv in ("key", "value")]
    inputs.append({"name": "conv_cache", "dtype": "float32", "shape": [2, 11, 320, 2]})
    meta = {**_meta("float32"), **{f"flow_estimator_batch_b{b}_w64": {"file": f"b{b}.onnx", "inputs": inputs}
                                   for b in (1, 2, 4, 8)}}
    assert flow_lane_plans(meta, 10) == {"orin-nano-8gb": 0, "orin-nx-16gb": 1, "agx-orin-32gb": 2,
                                         "agx-orin-64gb": 4}
    assert flow_lane_plans(_meta("float32"), 10) == {}  # no batched graphs
