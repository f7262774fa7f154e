"""fp16 graphs with onnxruntime's transformer float16 tool (onnxconverter-common
1.16's converter leaves Cast-to-float nodes mistyped on these graphs): fp32 inputs and outputs, the ops
that overflow in fp16 kept in fp32."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import onnx

from edge_build.quantize.policy import FP32_OPS
from models.errors import MissingExtraError

# Besides FP32_OPS: index and shape arithmetic that must stay exact, and
# reductions whose sums overflow fp16's 65504.
FP16_BLOCK_OPS = tuple(FP32_OPS) + ("Range", "CumSum", "ReduceSum", "ReduceMax", "TopK", "ArgMax")


def convert_fp16(src: Path, dst: Path, block_nodes: Sequence[str] = ()) -> None:
    try:
        from onnxruntime.transformers import float16
    except ImportError as exc:
        raise MissingExtraError("onnxruntime", "build", "fp16 conversion") from exc
    # Its info lines dump whole NodeProtos ("consider adding these nodes to the block list").
    logging.getLogger(float16.__name__).setLevel(logging.WARNING)
    model = onnx.load(str(src))
    op_block = sorted(set(float16.DEFAULT_OP_BLOCK_LIST) | set(FP16_BLOCK_OPS))
    converted = float16.convert_float_to_float16(model, keep_io_types=True, op_block_list=op_block,
                                                 node_block_list=list(block_nodes))
    big = converted.ByteSize() > (1 << 30)
    onnx.save(converted, str(dst), save_as_external_data=big,
              location=dst.name + ".data" if big else None)
