"""The fused batched decode step (llm_decode_fused_b<B>: GroupQueryAttention
over one in-place KV buffer, rotary from cos/sin caches, SkipSimplified
LayerNormalization) against the plain llm_decode step of each stream alone:
rows of different lengths, a stream joining mid-way, one leaving, two batch
sizes over the same buffer, idle rows left untouched below the scratch
position (their `seqlens_k` is C - 1, where only they write)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from cosyedge_build.export.llm import llm_dims
from cosyedge_build.export.llm_fused import export_fused_decode

from tests.edge_build.conftest import Checkpoint
from tests.edge_build.export.test_parity_llm import prompts
from tests.edge_build.parity import TOLERANCE, max_rel, to_numpy

POSITIONS = 48  # cache positions of the test's fused graphs
ROWS = 4  # slot rows of the buffer (the largest batch size)


class FusedRunner:
    """Binds a fused step's per-layer K/V to views of one buffer (input and output the same memory)."""

    def __init__(self, path: Path, buffer: np.ndarray) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 2
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.batch = int(self.session.get_inputs()[0].shape[0])
        self.buffer = buffer

    def run(self, embeds: np.ndarray, seqlens: np.ndarray) -> np.ndarray:
        b, buf = self.batch, self.buffer
        binding = self.session.io_binding()
        binding.bind_cpu_input("inputs_embeds", np.ascontiguousarray(embeds[:b], np.float32))
        binding.bind_cpu_input("seqlens_k", seqlens[:b].astype(np.int32))
        shape = [b, *buf.shape[3:]]
        for i in range(buf.shape[0]):
            for k, kind in enumerate(("key", "value")):
                ptr = buf[i, k].ctypes.data  # rows 0..b-1 of layer i's K or V: contiguous
                binding.bind_input(f"past_{kind}_{i}", "cpu", 0, np.float32, shape, ptr)
                binding.bind_output(f"present_{kind}_{i}", "cpu", 0, np.float32, shape, ptr)
        binding.bind_output("logp", "cpu")
        self.session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[-1]  # logp was bound last


@torch.no_grad()
def test_fused_rows_equal_the_plain_step_alone(checkpoint: Checkpoint, tmp_path: Path) -> None:
    llm = checkpoint.refs.llm
    dims = llm_dims(llm)
    stages = export_fused_decode(llm, tmp_path, [2, ROWS], POSITIONS)
    assert [s.name for s in stages] == ["llm_decode_fused_b2", f"llm_decode_fused_b{ROWS}", "llm_fused_kv_insert"]
    stages = stages[:2]
    buffer = np.zeros((dims["num_layers"], 2, ROWS, dims["num_kv_heads"], POSITIONS, dims["head_dim"]), np.float32)
    runners = {s.extra["batch"]: FusedRunner(tmp_path / s.file, buffer) for s in stages}
    for s in stages:  # what the manifest records is what the file declares
        session = runners[s.extra["batch"]].session
        assert [(v.name, tuple(v.shape)) for v in session.get_inputs()] == [(t.name, t.shape) for t in s.inputs]
        assert [(v.name, tuple(v.shape)) for v in session.get_outputs()] == [(t.name, t.shape) for t in s.outputs]
    prefill, decode = checkpoint.session("llm_prefill"), checkpoint.session("llm_decode")
    streams = prompts(llm, seed=11)  # three prompts of different lengths
    plain: dict[int, np.ndarray] = {}  # stream -> its cache from the plain graphs, run alone
    lengths = np.zeros(ROWS, np.int64)
    g = torch.Generator().manual_seed(12)

    def join(stream: int, row: int) -> None:
        x = to_numpy(streams[stream])
        _, kv = prefill.run(None, {"inputs_embeds": x, "attention_mask": np.ones((1, x.shape[1]), np.int64)})
        plain[stream] = kv
        buffer[:, :, row] = 0.0
        buffer[:, :, row, :, : x.shape[1]] = kv[:, :, 0]
        lengths[row] = x.shape[1]

    def step(rows: dict[int, int]) -> None:
        batch = min(b for b in runners if b > max(rows))
        embeds = np.zeros((ROWS, 1, dims["hidden_size"]), np.float32)
        active = np.zeros(ROWS, np.int32)
        tokens = torch.randint(0, llm.speech_token_size, (ROWS,), generator=g)
        for row in rows:
            embeds[row, 0] = to_numpy(llm.speech_embedding.weight[tokens[row]])
            active[row] = 1
        seqlens = np.where(active > 0, lengths, POSITIONS - 1).astype(np.int32)  # idle: the scratch position
        idle = [r for r in range(ROWS) if r not in rows]
        idle_before = buffer[:, :, idle, :, : POSITIONS - 1].copy()
        logp = runners[batch].run(embeds, seqlens)
        assert logp.shape == (batch, dims["speech_vocab_size"])
        for row, stream in rows.items():
            n = int(lengths[row])
            ref, kv = decode.run(None, {"inputs_embeds": embeds[row : row + 1],
                                        "attention_mask": np.ones((1, n + 1), np.int64), "past_kv": plain[stream]})
            plain[stream] = kv
            assert max_rel(logp[row], ref[0]) < TOLERANCE
            assert max_rel(buffer[:, :, row, :, : n + 1], kv[:, :, 0]) < TOLERANCE  # written in place
            lengths[row] = n + 1
        np.testing.assert_array_equal(buffer[:, :, idle, :, : POSITIONS - 1], idle_before)

    join(0, 0)
    join(1, 1)
    step({0: 0, 1: 1})  # batch 2
    step({0: 0, 1: 1})
    join(2, 2)  # joins: batch 4, row 3 idle
    step({0: 0, 1: 1, 2: 2})
    step({0: 0, 1: 1, 2: 2})
    step({1: 1, 2: 2})  # stream 0 leaves: row 0 idle, its cache untouched
    step({1: 1})  # a single row with an idle row below it: batch 2


def test_fp16_graphs_keep_the_cache_and_the_compute_in_fp16(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`precision="fp16"` (what ort-cuda's fp16-only GroupQueryAttention needs): the cache I/O,
    the weights, the rotary caches and every MatMul in fp16, `inputs_embeds` and `logp` float32
    with the LogSoftmax in fp32; the manifest fields say so; the insert graph casts a float32
    prefill cache into the fp16 row (the parity is tests/models/batching/test_fused_step.py)."""
    import onnx
    from cosyedge_build.reference.modules import load_reference

    llm = load_reference(tiny_model_dir).llm
    step, insert = export_fused_decode(llm, tmp_path, [2], POSITIONS, "fp16")
    cache = ("past_key_", "past_value_", "present_key_", "present_value_", "row_")
    for stage in (step, insert):
        assert stage.extra["precision"] == "fp16" and stage.extra["kv_cache"]["dtype"] == "float16"
        specs = (*stage.inputs, *stage.outputs)
        assert {t.dtype for t in specs if t.name.startswith(cache)} == {"float16"}
        session = ort.InferenceSession(str(tmp_path / stage.file), providers=["CPUExecutionProvider"])
        declared = {v.name: v.type for v in (*session.get_inputs(), *session.get_outputs())}
        numpy_of = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(int32)": "int32",
                    "tensor(int64)": "int64"}
        assert {t.name: t.dtype for t in specs} == {k: numpy_of[v] for k, v in declared.items()}
    assert [t.dtype for t in step.inputs if t.name == "inputs_embeds"] == ["float32"]
    assert [t.dtype for t in step.outputs if t.name == "logp"] == ["float32"]

    graph = onnx.load(str(tmp_path / step.file)).graph
    f16 = onnx.TensorProto.FLOAT16
    inits = {i.name: i.data_type for i in graph.initializer}
    assert inits["cos_cache"] == inits["sin_cache"] == f16
    matmuls = [n for n in graph.node if n.op_type == "MatMul"]
    assert matmuls and all(inits[n.input[1]] == f16 for n in matmuls)
    producer = {o: n for n in graph.node for o in n.output}
    (logsoftmax,) = [n for n in graph.node if n.op_type == "LogSoftmax"]
    cast = producer[logsoftmax.input[0]]
    assert cast.op_type == "Cast" and cast.attribute[0].i == onnx.TensorProto.FLOAT

    dims = llm_dims(llm)
    t = 5
    # a batched prefill's cache of three prompts: the insert takes the one at batch_row
    kv = np.random.default_rng(3).standard_normal(
        (dims["num_layers"], 2, 3, dims["num_kv_heads"], t, dims["head_dim"])).astype(np.float32)
    session = ort.InferenceSession(str(tmp_path / insert.file), providers=["CPUExecutionProvider"])
    feeds = {"present_kv": kv, "batch_row": np.array([1], np.int64)}
    rows = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
    for i in range(dims["num_layers"]):
        for k, kind in enumerate(("key", "value")):
            row = rows[f"row_{kind}_{i}"]
            assert row.dtype == np.float16 and row.shape == (1, dims["num_kv_heads"], POSITIONS, dims["head_dim"])
            np.testing.assert_array_equal(row[:, :, :t], kv[i, k, 1:2].astype(np.float16))
            assert not row[:, :, t:].any()
