"""Small random stand-ins for the two ONNX models a CosyVoice 2 checkpoint
ships (campplus speaker embedding, speech tokenizer v2), with the real ones'
inputs and outputs. Built with onnx.helper: no exporter, no torch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from cosyedge_build.reference.modules import require

OPSET = 17
CAMPPLUS_FBANK_BINS = 80
SPEAKER_EMBEDDING_DIM = 192
WHISPER_MEL_BINS = 128
SPEECH_TOKEN_SIZE = 6561


def _init(rng: np.random.Generator, *shape: int) -> np.ndarray:
    fan_in = int(np.prod(shape[1:])) if len(shape) > 2 else shape[0]
    return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)


def write_campplus(path: Path, rng: np.random.Generator, hidden: int = 64) -> None:
    """fbank [B, T, 80] -> embedding [B, 192]: per-frame MLP, mean over time."""
    onnx = require("onnx", "onnx", "writing the tiny campplus.onnx")
    h, t = onnx.helper, onnx.TensorProto
    inits = [
        onnx.numpy_helper.from_array(_init(rng, CAMPPLUS_FBANK_BINS, hidden), "w1"),
        onnx.numpy_helper.from_array(np.zeros(hidden, np.float32), "b1"),
        onnx.numpy_helper.from_array(_init(rng, hidden, SPEAKER_EMBEDDING_DIM) * 4.0, "w2"),
        onnx.numpy_helper.from_array(np.zeros(SPEAKER_EMBEDDING_DIM, np.float32), "b2"),
    ]
    nodes = [
        h.make_node("MatMul", ["input", "w1"], ["m1"]),
        h.make_node("Add", ["m1", "b1"], ["a1"]),
        h.make_node("Tanh", ["a1"], ["h1"]),
        h.make_node("ReduceMean", ["h1"], ["pooled"], axes=[1], keepdims=0),
        h.make_node("MatMul", ["pooled", "w2"], ["m2"]),
        h.make_node("Add", ["m2", "b2"], ["output"]),
    ]
    graph = h.make_graph(
        nodes,
        "campplus_tiny",
        [h.make_tensor_value_info("input", t.FLOAT, ["B", "T", CAMPPLUS_FBANK_BINS])],
        [h.make_tensor_value_info("output", t.FLOAT, ["B", SPEAKER_EMBEDDING_DIM])],
        inits,
    )
    _save(onnx, graph, path)


def write_speech_tokenizer(path: Path, rng: np.random.Generator, hidden: int = 32) -> None:
    """whisper log-mel [1, 128, T] + length [1] int32 -> tokens [1, ceil(T/4)]
    int64 in [0, 6561): two stride-2 convolutions and an argmax."""
    onnx = require("onnx", "onnx", "writing the tiny speech_tokenizer_v2.onnx")
    h, t = onnx.helper, onnx.TensorProto
    inits = [
        onnx.numpy_helper.from_array(_init(rng, hidden, WHISPER_MEL_BINS, 3), "c1"),
        onnx.numpy_helper.from_array(_init(rng, hidden, hidden, 3), "c2"),
        onnx.numpy_helper.from_array(_init(rng, hidden, SPEECH_TOKEN_SIZE), "proj"),
        onnx.numpy_helper.from_array(np.array(0, np.int64), "zero"),
        onnx.numpy_helper.from_array(np.array(1, np.int64), "one"),
        onnx.numpy_helper.from_array(np.array([2], np.int64), "axis2"),
        onnx.numpy_helper.from_array(np.array([0, 1], np.int64), "axes01"),
    ]
    nodes = [
        # frames at or past feats_length do not count
        h.make_node("Shape", ["feats"], ["shape"]),
        h.make_node("Gather", ["shape", "axis2"], ["t_vec"], axis=0),
        h.make_node("Squeeze", ["t_vec"], ["t"]),
        h.make_node("Range", ["zero", "t", "one"], ["frames"]),
        h.make_node("Cast", ["feats_length"], ["length"], to=t.INT64),
        h.make_node("Less", ["frames", "length"], ["valid"]),
        h.make_node("Cast", ["valid"], ["valid_f"], to=t.FLOAT),
        h.make_node("Unsqueeze", ["valid_f", "axes01"], ["mask"]),
        h.make_node("Mul", ["feats", "mask"], ["x0"]),
        h.make_node("Conv", ["x0", "c1"], ["x1"], strides=[2], pads=[1, 1]),
        h.make_node("Tanh", ["x1"], ["y1"]),
        h.make_node("Conv", ["y1", "c2"], ["x2"], strides=[2], pads=[1, 1]),
        h.make_node("Tanh", ["x2"], ["y2"]),
        h.make_node("Transpose", ["y2"], ["y2t"], perm=[0, 2, 1]),
        h.make_node("MatMul", ["y2t", "proj"], ["logits"]),
        h.make_node("ArgMax", ["logits"], ["indices"], axis=-1, keepdims=0),
    ]
    graph = h.make_graph(
        nodes,
        "speech_tokenizer_v2_tiny",
        [
            h.make_tensor_value_info("feats", t.FLOAT, [1, WHISPER_MEL_BINS, "T"]),
            h.make_tensor_value_info("feats_length", t.INT32, [1]),
        ],
        [h.make_tensor_value_info("indices", t.INT64, [1, "T_tokens"])],
        inits,
    )
    _save(onnx, graph, path)


def _save(onnx, graph, path: Path) -> None:  # type: ignore[no-untyped-def]
    model = onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", OPSET)], producer_name="cosyedge-tiny"
    )
    model.ir_version = 8  # readable by onnxruntime >= 1.14 (the Jetson wheels included)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
