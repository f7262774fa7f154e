"""A tiny LLM prefill/decode pair in the bundle contract's I/O (BUNDLE.md),
built with onnx.helper, for testing KV-cache handling on the CPU.

Per layer and head: K and V are linear in the input scaled by the position
(1 + 0.1 * pos, pos = cumsum(mask) - 1, as the real graph computes position
ids), attention over the whole cache with mask zeros as -1e9, logp from the
last position. Padding anywhere in the mask is honoured, as the contract
requires of the exported decode graph."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

L, H, HD, D, V = 2, 2, 4, 8, 11


def _weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w_kv": rng.standard_normal((L, 2, D, H * HD)).astype(np.float32) * 0.5,
        "w_q": rng.standard_normal((D, H * HD)).astype(np.float32) * 0.5,
        "w_o": rng.standard_normal((H * HD, V)).astype(np.float32) * 0.5,
    }


def build(path: Path, with_past: bool, seed: int = 0) -> Path:
    w = _weights(seed)
    c = numpy_helper.from_array
    inits = [c(w["w_kv"], "w_kv"), c(w["w_q"], "w_q"), c(w["w_o"], "w_o"),
             c(np.array([1], np.int64), "one_i"), c(np.array(1.0, np.float32), "one_f"),
             c(np.array(0.1, np.float32), "tenth"), c(np.array(-1e9, np.float32), "neg"),
             c(np.array([1], np.int64), "ax1"), c(np.array([2], np.int64), "ax2"),
             c(np.array([np.iinfo(np.int64).max], np.int64), "big"), c(np.array([-1], np.int64), "minus1"),
             c(np.array([L, 2, -1, H, HD], np.int64), "kv5"), c(np.array([0, H * HD], np.int64), "qshape"),
             c(np.array([0, 0, H, HD], np.int64), "q4"), c(np.array([0, -1], np.int64), "flat"),
             c(np.array(1.0 / np.sqrt(HD), np.float32), "scale"), c(np.array([0], np.int64), "zero_i")]
    inits += [c(np.array([lay], np.int64), f"i{lay}") for lay in range(L)]
    inits += [c(np.array([kv], np.int64), f"k{kv}") for kv in range(2)]
    n = helper.make_node
    nodes = [
        # positions of the new tokens: (cumsum(mask) - 1)[-T:]
        n("CumSum", ["attention_mask", "one_i"], ["cs"]),
        n("Sub", ["cs", "one_i"], ["pos_i"]),
        n("Cast", ["pos_i"], ["pos_f"], to=TensorProto.FLOAT),
        n("Shape", ["inputs_embeds"], ["xs"]),
        n("Gather", ["xs", "one_i"], ["t1"], axis=0),
        n("Neg", ["t1"], ["neg_t"]),
        n("Slice", ["pos_f", "neg_t", "big", "ax1"], ["pos_new"]),  # [1, T]
        n("Mul", ["pos_new", "tenth"], ["p10"]),
        n("Add", ["p10", "one_f"], ["pscale"]),  # [1, T]
        n("Unsqueeze", ["pscale", "minus1"], ["pscale3"]),  # [1, T, 1]
        # new K/V for all layers: x [1,T,D] @ w_kv [L,2,D,HHD] -> [L,2,T,HHD]
        n("MatMul", ["inputs_embeds", "w_kv"], ["kv_raw"]),
        n("Mul", ["kv_raw", "pscale3"], ["kv_pos"]),
        n("Reshape", ["kv_pos", "kv5"], ["kv5d"]),  # [L,2,T,H,HD]
        n("Transpose", ["kv5d"], ["kvt"], perm=[0, 1, 3, 2, 4]),  # [L,2,H,T,HD]
        n("Unsqueeze", ["kvt", "ax2"], ["new_kv"]),  # [L,2,1,H,T,HD]
    ]
    if with_past:
        nodes.append(n("Concat", ["past_kv", "new_kv"], ["present_kv"], axis=4))
    else:
        nodes.append(n("Identity", ["new_kv"], ["present_kv"]))
    nodes += [
        n("MatMul", ["inputs_embeds", "w_q"], ["q_raw"]),
        n("Reshape", ["q_raw", "q4"], ["q4d"]),
        n("Transpose", ["q4d"], ["q"], perm=[0, 2, 1, 3]),  # [1,H,T,HD]
        n("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        n("Sub", ["one_f", "mask_f"], ["inv"]),
        n("Mul", ["inv", "neg"], ["bias2"]),
        n("Unsqueeze", ["bias2", "ax1"], ["bias3"]),
        n("Unsqueeze", ["bias3", "ax1"], ["bias"]),  # [1,1,1,Ttot]
    ]
    outs = []
    for lay in range(L):
        nodes += [
            n("Gather", ["present_kv", f"i{lay}"], [f"pl{lay}"], axis=0),  # [1,2,1,H,Tt,HD]
            n("Squeeze", [f"pl{lay}", "zero_i"], [f"ps{lay}"]),  # [2,1,H,Tt,HD]
            n("Gather", [f"ps{lay}", "k0"], [f"kk{lay}"], axis=0),
            n("Squeeze", [f"kk{lay}", "zero_i"], [f"K{lay}"]),  # [1,H,Tt,HD]
            n("Gather", [f"ps{lay}", "k1"], [f"vv{lay}"], axis=0),
            n("Squeeze", [f"vv{lay}", "zero_i"], [f"V{lay}"]),
            n("Transpose", [f"K{lay}"], [f"KT{lay}"], perm=[0, 1, 3, 2]),
            n("MatMul", ["q", f"KT{lay}"], [f"s{lay}"]),
            n("Mul", [f"s{lay}", "scale"], [f"ss{lay}"]),
            n("Add", [f"ss{lay}", "bias"], [f"sb{lay}"]),
            n("Softmax", [f"sb{lay}"], [f"a{lay}"], axis=-1),
            n("MatMul", [f"a{lay}", f"V{lay}"], [f"o{lay}"]),  # [1,H,T,HD]
        ]
        outs.append(f"o{lay}")
    nodes += [
        n("Sum", outs, ["o"]),
        n("Slice", ["o", "minus1", "big", "ax2"], ["o_last"]),  # [1,H,1,HD]
        n("Reshape", ["o_last", "flat"], ["o_flat"]),  # [1, H*HD]
        n("MatMul", ["o_flat", "w_o"], ["logits"]),
        n("LogSoftmax", ["logits"], ["logp"], axis=-1),
    ]
    t_new = 1 if with_past else "T"
    total = "P1" if with_past else "T"
    inputs = [helper.make_tensor_value_info("inputs_embeds", TensorProto.FLOAT, [1, t_new, D]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [1, total])]
    if with_past:
        inputs.append(helper.make_tensor_value_info("past_kv", TensorProto.FLOAT, [L, 2, 1, H, "P", HD]))
    outputs = [helper.make_tensor_value_info("logp", TensorProto.FLOAT, [1, V]),
               helper.make_tensor_value_info("present_kv", TensorProto.FLOAT, [L, 2, 1, H, total, HD])]
    graph = helper.make_graph(nodes, "tiny_llm", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path
