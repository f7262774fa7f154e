"""The estimator windows batched across streams (flow_estimator_batch_b<B>_w<W>,
edge_build/export/flow_batch.py) against the single-stream fixed-shape graph
(flow_static.py) run for each stream alone: each row's dphi_dt, the K/V written
in place into the shared buffer and the conv history, with the streams at
different cache lengths, committing or not, one idle (its cache untouched)
and one with a bounded left context. (The second tiny checkpoint's two-level
U-Net is not chunk-causal: its export is refused, as the single-stream one.)"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from cosyedge_build.export import hyperparams
from cosyedge_build.export.flow_batch import ATTENTIONS, buffer_frames, export_batch_estimators, kv_names
from cosyedge_build.export.flow_estimator import cache_dims, transformer_blocks
from cosyedge_build.export.flow_static import export_static_estimators

from tests.edge_build.conftest import Checkpoint
from tests.edge_build.parity import TOLERANCE, max_rel

WINDOW = 64
CACHE_FRAMES = 160
BATCH = 2


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@dataclass
class Alone:
    """One stream's state for the single-stream graph."""

    att: np.ndarray  # [S, L, 2, 2, H, D]
    conv: np.ndarray
    length: int = 0


def _run_batch(session: ort.InferenceSession, feeds: dict[str, np.ndarray], buffer: np.ndarray,
               conv: np.ndarray) -> np.ndarray:
    """One batched call with every block's K/V bound in place to its view of `buffer`."""
    n = feeds["x"].shape[0]
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_cpu_input(name, np.ascontiguousarray(value))
    binding.bind_cpu_input("conv_cache", conv)
    binding.bind_output("dphi_dt", "cpu")
    binding.bind_output("conv_cache_new", "cpu")
    kv_in, kv_out = kv_names(buffer.shape[0])
    declared = [int(d) for d in session.get_inputs()[[i.name for i in session.get_inputs()].index(kv_in[0])].shape]
    for j, (name_in, name_out) in enumerate(zip(kv_in, kv_out, strict=True)):
        view = buffer[j // 2, j % 2, :n]  # rows 0..N-1: contiguous
        assert int(np.prod(declared)) == view.size  # [N, H, F, D], or the fused graphs' [N, H, F, D / P, P]
        binding.bind_input(name_in, "cpu", 0, np.float32, declared, view.ctypes.data)
        binding.bind_output(name_out, "cpu", 0, np.float32, declared, view.ctypes.data)
    session.run_with_iobinding(binding)
    dphi, conv_new = binding.copy_outputs_to_cpu()[:2]
    conv[...] = conv_new  # as the runtime does
    return dphi


@torch.no_grad()
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_batched_rows_equal_the_single_stream_graph(checkpoint: Checkpoint, tmp_path: Path, attention: str) -> None:
    hyper = hyperparams.collect(checkpoint.refs)
    chunk = int(hyper["flow"]["chunk_tokens"]) * int(hyper["token_mel_ratio"])
    assert chunk < WINDOW  # the windows below commit a complete chunk and carry an unfinished one
    flow = checkpoint.refs.flow
    if not cache_dims(flow.decoder.estimator)["stream_cache"]:  # tiny2: a two-level U-Net, not chunk-causal
        with pytest.raises(ValueError, match="chunk-causal"):
            export_batch_estimators(flow, tmp_path, [BATCH], [WINDOW], CACHE_FRAMES, chunk)
        return
    (stage,) = export_batch_estimators(flow, tmp_path, [BATCH], [WINDOW], CACHE_FRAMES, chunk, attention=attention)
    assert stage.extra["attention"] == attention
    nodes = onnx.load(str(tmp_path / stage.file)).graph.node
    ops = Counter(node.op_type for node in nodes)
    est = flow.decoder.estimator
    blocks_in_graph = len(transformer_blocks(est))
    levels = len(est.down_blocks) + len(est.mid_blocks) + len(est.up_blocks)
    assert ops["ScatterND"] == 2 * blocks_in_graph  # each block's K and V, in place:
    # each writes a bound buffer straight into its output (a Reshape between would make onnxruntime copy it)
    model_graph = onnx.load(str(tmp_path / stage.file)).graph
    ins, outs = {v.name for v in model_graph.input}, {v.name for v in model_graph.output}
    assert all(node.input[0] in ins and node.output[0] in outs for node in nodes if node.op_type == "ScatterND")
    kv_rank = len(next(t for t in stage.inputs if t.name == "key_cache_0").shape)
    assert kv_rank == (5 if attention == "fused" else 4)  # fused: [N, H, F, D / P, P], P values a write's thread
    if attention == "fused":  # one contrib attention and one bias + GELU a block, nothing of the plain ones left
        assert ops["MultiHeadAttention"] == ops["BiasGelu"] == blocks_in_graph
        assert ops["Softmax"] == 0
        # every norm but a level's first is a SkipLayerNormalization (projection bias + residual + LayerNorm),
        # its mean and inv_std_var outputs left out
        skips = [node for node in nodes if node.op_type == "SkipLayerNormalization"]
        assert len(skips) == 2 * blocks_in_graph - levels
        assert all(list(node.output)[1:3] == ["", ""] and node.output[3] for node in skips)
    else:
        assert ops["MultiHeadAttention"] == ops["BiasGelu"] == ops["SkipLayerNormalization"] == 0
        assert ops["Softmax"] == blocks_in_graph
    (single_stage,) = export_static_estimators(flow, tmp_path, [WINDOW], CACHE_FRAMES, chunk)
    batch, single = _session(tmp_path / stage.file), _session(tmp_path / single_stage.file)
    # what the manifest records is what the file declares
    assert [(v.name, tuple(v.shape)) for v in batch.get_inputs()] == [(t.name, t.shape) for t in stage.inputs]
    assert [(v.name, tuple(v.shape)) for v in batch.get_outputs()] == [(t.name, t.shape) for t in stage.outputs]
    assert stage.extra["buffer_frames"] == buffer_frames(CACHE_FRAMES, [WINDOW]) == CACHE_FRAMES + WINDOW

    att_shape = single.get_inputs()[6].shape  # [S, L, 2, 2, H, D]
    conv_shape = single.get_inputs()[8].shape  # [K, 2, Cmax, 2]
    blocks, heads, hd = att_shape[1], att_shape[4], att_shape[5]
    n, c = 2 * BATCH, int(batch.get_inputs()[0].shape[1])
    frames = stage.extra["buffer_frames"]
    buffer = np.zeros((blocks, 2, n, heads, frames, hd), np.float32)  # [L, K|V, rows, H, F, D]
    conv = np.zeros((n, conv_shape[0], *conv_shape[2:]), np.float32)  # rows first
    alone = [Alone(np.zeros(att_shape, np.float32), np.zeros(conv_shape, np.float32)) for _ in range(BATCH)]
    rng = np.random.default_rng(5)

    def call(used: list[int], commits: list[int], active: list[bool], first: list[int]) -> None:
        mask = np.zeros((n, 1, WINDOW), np.float32)
        for s in range(BATCH):
            mask[2 * s: 2 * s + 2, :, : used[s]] = 1.0
        feeds = {name: rng.standard_normal((n, c, WINDOW)).astype(np.float32) * mask for name in ("x", "mu", "cond")}
        feeds |= {"mask": mask, "t": rng.random(n).astype(np.float32),
                  "spks": rng.standard_normal((n, c)).astype(np.float32),
                  "cache_first": np.array(first, np.int64),
                  "cache_len": np.array([a.length for a in alone], np.int64),
                  # an idle row commits nothing: its K/V go past its length, its conv history stays
                  "commit": np.array([k if on else 0 for k, on in zip(commits, active, strict=True)], np.int64)}
        idle_before = {s: (buffer[:, :, 2 * s: 2 * s + 2, :, : alone[s].length].copy(),
                           conv[2 * s: 2 * s + 2].copy()) for s in range(BATCH) if not active[s]}
        dphi = _run_batch(batch, feeds, buffer, conv)
        for s, a in enumerate(alone):
            rows = slice(2 * s, 2 * s + 2)
            if not active[s]:
                kv, hist = idle_before[s]
                np.testing.assert_array_equal(buffer[:, :, rows, :, : a.length], kv)
                np.testing.assert_array_equal(conv[rows], hist)
                continue
            valid = np.zeros(CACHE_FRAMES, np.float32)
            valid[first[s]: a.length] = 1.0
            ref, att_window, conv_new = single.run(None, {
                "x": feeds["x"][rows], "mask": mask[rows], "mu": feeds["mu"][rows], "t": feeds["t"][rows],
                "spks": feeds["spks"][rows], "cond": feeds["cond"][rows], "att_cache": a.att,
                "cache_valid": valid, "conv_cache": a.conv,
                "commit_index": np.array([commits[s], commits[s] + 1], np.int64)})
            assert max_rel(dphi[rows, :, : used[s]], ref[:, :, : used[s]]) < TOLERANCE
            if commits[s]:  # as ort_static_flow.py does with the single-stream outputs
                a.att[a.length: a.length + commits[s]] = att_window[: commits[s]]
                a.conv = conv_new
                a.length += commits[s]
            if a.length:  # the committed K/V, in attention layout, written in place
                expected = a.att[: a.length].transpose(1, 2, 3, 4, 0, 5)  # -> [L, K|V, 2, H, S, D]
                assert max_rel(buffer[:, :, rows, :, : a.length], expected) < TOLERANCE
                assert max_rel(conv[rows], a.conv.transpose(1, 0, 2, 3)) < TOLERANCE

    call([WINDOW, WINDOW - 20], [chunk, 0], [True, True], [0, 0])  # both start; stream 1 commits nothing
    call([WINDOW - 10, WINDOW], [0, chunk], [True, True], [0, 0])  # lengths chunk and 0
    call([WINDOW, WINDOW], [chunk, chunk], [True, False], [0, 0])  # stream 1 idle in the batch
    call([WINDOW - 5, WINDOW], [chunk, chunk], [True, True], [chunk // 2, 0])  # bounded left context on 0
    assert alone[0].length == 3 * chunk and alone[1].length == 2 * chunk
