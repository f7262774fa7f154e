"""The fp16 variant of the batched estimator windows (build export --batch-flow-precision fp16):
K/V lanes in fp16 at half the bytes, the same calls as the fp32 lanes within fp16's tolerance,
no NaN from an idle lane, a saved voice seeded through the cast, reads back in fp32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cosyedge_models.backends.factory import create_backend
from cosyedge_models.backends.flow_cache import PrefixRows
from cosyedge_models.backends.ort_cache import DeviceCopier
from cosyedge_models.batching.batched_flow import BatchFlowGraphs, SlotCall, batch_flow_sessions, lane_bytes
from cosyedge_models.bundle.loader import load_bundle
from cosyedge_models.bundle.memory_budget import flow_lane_plans

from tests.conftest import BATCH_FLOW_SIZES, STATIC_FLOW_CACHE, STATIC_FLOW_WINDOWS
from tests.models.batching.test_batched_flow import _feeds


def _graphs(root: Path) -> tuple[BatchFlowGraphs, dict, int]:  # type: ignore[type-arg]
    bundle = load_bundle(root)
    backend = create_backend("ort")
    sessions = batch_flow_sessions(bundle, lambda name, path: backend.load(name, path, threads=1))
    graphs = BatchFlowGraphs(sessions, ("cpu", 0), DeviceCopier("cpu"))
    graphs.warm_up()
    chunk = int(bundle.manifest["stages"][f"flow_estimator_batch_b1_w{STATIC_FLOW_WINDOWS[0]}"]["chunk_frames"])
    return graphs, sessions, chunk


def _snr_db(ref: np.ndarray, out: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / max(np.sum((ref - out) ** 2.0), 1e-30)))


@pytest.mark.parametrize("variant", ["static_flow_fp16_bundle", "static_flow_fused_fp16_bundle"])
def test_fp16_lanes_follow_the_fp32_lanes_at_half_the_bytes(static_flow_bundle: Path, variant: str,
                                                           request: pytest.FixtureRequest) -> None:
    """The fp16 lanes, their attention plain or onnxruntime's MultiHeadAttention (fused), against
    the plain fp32 lanes."""
    static_flow_fp16_bundle = request.getfixturevalue(variant)
    g32, s32, chunk = _graphs(static_flow_bundle)
    g16, s16, _ = _graphs(static_flow_fp16_bundle)
    assert g32.kv_dtype is np.float32 and g16.kv_dtype is np.float16
    assert sorted(s16) == [(b, w) for b in BATCH_FLOW_SIZES for w in STATIC_FLOW_WINDOWS]
    assert all(s.input_types["x"] == "tensor(float)" and s.input_types["key_cache_0"] == "tensor(float16)"
               for s in s16.values())
    # half the K/V bytes (the conv history stays fp32): the engine's lanes and the boards' budget
    conv = 2 * int(np.prod(g32.conv_row)) * 4
    assert g16.slot_bytes - conv == (g32.slot_bytes - conv) // 2
    assert lane_bytes(s16, 10) == 10 * g16.slot_bytes < lane_bytes(s32, 10)
    plans16 = flow_lane_plans(load_bundle(static_flow_fp16_bundle).manifest["stages"], 10)
    plans32 = flow_lane_plans(load_bundle(static_flow_bundle).manifest["stages"], 10)
    assert plans16.keys() == plans32.keys() and all(plans16[k] >= plans32[k] for k in plans32)

    rng = np.random.default_rng(5)
    channels = int(s32[(1, STATIC_FLOW_WINDOWS[0])].input_shapes["x"][1])
    # a saved voice's prefix in slot 0 (through the cast of the layout graph), slot 1 new
    prefix = PrefixRows(rng.standard_normal((chunk, g32.blocks, 2, 2, g32.kv_row[0], g32.kv_row[2])).astype(np.float32))
    history = rng.standard_normal((2, *g32.conv_row)).astype(np.float32)
    for g in (g32, g16):
        g.seed(0, prefix, history)
        g.reset(1)
    kv16, conv16 = g16.read_slot(0)
    assert kv16.dtype == np.float32 and kv16.shape[4] == chunk
    np.testing.assert_allclose(kv16, g32.read_slot(0)[0], rtol=1e-3, atol=1e-3)  # fp16 rounding only
    np.testing.assert_array_equal(conv16, history)

    # slot 1 idles through the first calls (its rows: zero inputs, every frame hidden), then speaks:
    # an idle lane's K/V must stay finite, or its next stream's attention reads NaN
    steps = [{0: (STATIC_FLOW_WINDOWS[0], chunk)}, {0: (100, chunk)},
             {0: (STATIC_FLOW_WINDOWS[0], chunk), 1: (STATIC_FLOW_WINDOWS[0], chunk)},
             {0: (40, 0), 1: (STATIC_FLOW_WINDOWS[1], 2 * chunk)}]
    for windows in steps:
        feeds = {slot: _feeds(rng, channels, frames) for slot, (frames, _) in windows.items()}
        outs = {}
        for g in (g32, g16):
            outs[g.kv_dtype] = g.run([SlotCall(slot, feeds[slot], commit) for slot, (_, commit) in windows.items()])
        for ref, out in zip(outs[np.float32], outs[np.float16], strict=True):
            assert np.isfinite(out).all()
            assert _snr_db(ref, out) > 30.0, _snr_db(ref, out)
    assert g16.lengths == g32.lengths == [4 * chunk, 3 * chunk]
    assert np.isfinite(g16.read_slot(1)[0]).all()
    for s in [*s32.values(), *s16.values()]:
        s.close()


def test_an_unknown_batched_flow_precision_is_refused_before_any_export(tiny_model_dir: Path,
                                                                        tmp_path: Path) -> None:
    from cosyedge_build.export import export_bundle

    with pytest.raises(ValueError, match=r"precision 'int8' is not one of fp32, fp16"):
        export_bundle(tiny_model_dir, tmp_path / "b", static_flow_windows=STATIC_FLOW_WINDOWS,
                      static_flow_cache=STATIC_FLOW_CACHE, batch_flow_sizes=(1,), batch_flow_precision="int8")
    assert not (tmp_path / "b").exists()
