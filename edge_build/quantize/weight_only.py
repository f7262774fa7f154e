"""Weight-only INT8 graphs for onnxruntime (precision `int8w`): every MatMul
with a constant weight becomes onnxruntime's MatMulNBits (8-bit blocks,
symmetric, one scale per block of `block_size` input channels), run with
int8 arithmetic (accuracy level 4: activations quantized per block on the
fly). On the CPU the LLM's decode step is bound by reading its weights, so a
quarter of the bytes is most of the gain; Q/DQ INT8 (precision `int8`) is the
TensorRT format and runs slower than fp32 on onnxruntime's CPU path.
MatMulNBits is an onnxruntime contrib op: TensorRT does not take these graphs."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import onnx
from cosyedge_models.errors import MissingExtraError

log = logging.getLogger(__name__)
BLOCK_SIZE = 32
ACCURACY_LEVEL = 4  # int8 x int8 products (onnxruntime's MatMulNBits accuracy levels: 0 fp32 ... 4 int8)


def quantize_weight_only(src: Path, dst: Path, exclude: Sequence[str] = (), block_size: int = BLOCK_SIZE) -> int:
    """Write `dst`; returns how many MatMul nodes became MatMulNBits."""
    try:
        from onnxruntime.quantization import matmul_nbits_quantizer as nbits
    except ImportError as exc:
        raise MissingExtraError("onnxruntime", "build", "weight-only int8 quantization") from exc
    logging.getLogger(nbits.__name__).setLevel(logging.WARNING)  # one info line per skipped node
    model = onnx.load(str(src))
    config = nbits.DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True,
                                                accuracy_level=ACCURACY_LEVEL, bits=8)
    quantizer = nbits.MatMulNBitsQuantizer(model, bits=8, block_size=block_size, is_symmetric=True,
                                           accuracy_level=ACCURACY_LEVEL, nodes_to_exclude=list(exclude),
                                           algo_config=config)
    quantizer.process()
    out = quantizer.model.model
    count = sum(1 for n in out.graph.node if n.op_type == "MatMulNBits")
    big = out.ByteSize() > (1 << 30)
    onnx.save_model(out, str(dst), save_as_external_data=big, location=dst.name + ".data" if big else None)
    log.info("%s: %d MatMul nodes to 8-bit MatMulNBits (%d excluded)", src.name, count, len(exclude))
    return count
