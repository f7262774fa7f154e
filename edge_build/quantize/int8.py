"""INT8 Q/DQ graphs with onnxruntime.quantization, in the form TensorRT's
explicit quantization takes: symmetric int8 activations and per-channel
symmetric int8 weights (zero points 0), biases left in fp32."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from cosyedge_build.quantize.capture import Feed
from cosyedge_build.quantize.policy import QUANT_OPS

log = logging.getLogger(__name__)

CALIBRATION_METHODS = ("minmax", "percentile")


class _FeedReader:
    """onnxruntime's CalibrationDataReader over recorded feeds."""

    def __init__(self, feeds: Sequence[Feed], input_names: set[str]) -> None:
        self._feeds = [{k: v for k, v in f.items() if k in input_names} for f in feeds]
        self._i = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._i >= len(self._feeds):
            return None
        self._i += 1
        return self._feeds[self._i - 1]

    def rewind(self) -> None:
        self._i = 0

    def __len__(self) -> int:
        return len(self._feeds)


def quantize_int8(src: Path, dst: Path, feeds: Sequence[Feed], exclude: Sequence[str],
                  method: str = "minmax") -> None:
    """Write `dst`: `src` with Q/DQ around every MatMul/Gemm/Conv not in `exclude`."""
    if method not in CALIBRATION_METHODS:
        raise ValueError(f"calibration method {method!r} is not one of {CALIBRATION_METHODS}")
    if not feeds:
        raise ValueError(f"no calibration feeds for {src.name}: the fp32 pipeline never ran this stage")
    model = onnx.load(str(src), load_external_data=False)
    names = {i.name for i in model.graph.input}
    big = src.stat().st_size > (1 << 30)
    # quantize_static writes a shape-inferred copy next to its input: work on a
    # link in our own directory so that the source bundle stays untouched.
    with tempfile.TemporaryDirectory(dir=dst.parent, prefix=".quantize-") as tmp:
        local = Path(tmp) / src.name
        _link(src, local)
        data = src.with_name(src.name + ".data")
        if data.exists():
            _link(data, local.with_name(data.name))
        _quantize(local, dst, feeds, names, exclude, method, big)


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _quantize(src: Path, dst: Path, feeds: Sequence[Feed], names: set[str], exclude: Sequence[str],
              method: str, big: bool) -> None:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    extra: dict[str, bool | float] = {
        "ActivationSymmetric": True, "WeightSymmetric": True,
        # TensorRT fuses fp32 biases itself; an int32 bias DQ buys nothing there.
        "QuantizeBias": False,
    }
    if method == "percentile":
        extra["CalibPercentile"] = 99.999
    quantize_static(
        str(src), str(dst), _FeedReader(feeds, names), quant_format=QuantFormat.QDQ,
        op_types_to_quantize=list(QUANT_OPS), per_channel=True, reduce_range=False,
        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, nodes_to_exclude=list(exclude),
        use_external_data_format=big,
        calibrate_method=CalibrationMethod.MinMax if method == "minmax" else CalibrationMethod.Percentile,
        extra_options=extra,
    )
    log.info("quantized %s -> %s (%d nodes excluded)", src.name, dst.name, len(exclude))
