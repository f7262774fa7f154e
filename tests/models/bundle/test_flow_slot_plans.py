"""The Jetson budget's fixed-shape flow slots per board (plan_batches over each board's memory),
against hand-computed counts."""

from __future__ import annotations

from cosyedge_models.backends.fixed_shapes import BatchPlan
from cosyedge_models.bundle.memory_budget import flow_slot_plans


def _meta(dtype: str) -> dict[str, object]:
    inputs = [{"name": "att_cache", "dtype": dtype, "shape": [1000, 1000, 100]},
              {"name": "conv_cache", "dtype": dtype, "shape": [1, 1]}]
    return {"flow_estimator_static_w64": {"file": "x.onnx", "inputs": inputs}}


def test_slots_per_board_follow_their_memory() -> None:
    # fp32: (1e8 + 1) elements x 4 B x 10 steps ~ 4.0e9 B a slot; a quarter of 7.4 / 15.3 / 30.0 / 61.3 GiB
    # is 1.99e9 / 4.11e9 / 8.05e9 / 16.45e9 B: 0 / 1 / 2 / 4 slots
    plans = flow_slot_plans(_meta("float32"), 10)
    assert {k: p.slots for k, p in plans.items()} == {
        "orin-nano-8gb": 0, "orin-nx-16gb": 1, "agx-orin-32gb": 2, "agx-orin-64gb": 4}
    assert plans["orin-nano-8gb"] == BatchPlan(0, (), 0)
    assert plans["agx-orin-64gb"].batch_sizes == (1, 2, 4)
    # fp16 caches: half a slot's bytes (2.0e9 B: still above the Nano's 1.99e9), at most the 8 asked
    half = flow_slot_plans(_meta("float16"), 10)
    assert {k: p.slots for k, p in half.items()} == {
        "orin-nano-8gb": 0, "orin-nx-16gb": 2, "agx-orin-32gb": 4, "agx-orin-64gb": 8}


def test_no_fixed_shape_graphs_no_plans() -> None:
    assert flow_slot_plans({"flow_estimator": {"file": "e.onnx"}}, 10) == {}
