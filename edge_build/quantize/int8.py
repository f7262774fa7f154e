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


# onnxruntime's MinMax calibrator keeps every intermediate tensor of every
# calibration run until it computes the ranges; at full size that is GBs per
# stage. Strided calibration folds them into running min/max after every
# `stride` feeds instead (min/max of min/max: the same ranges). Its
# CalibMaxIntermediateOutputs is no alternative: onnxruntime 1.32 drops the
# collected outputs at that count without folding them in.
CALIB_STRIDE = 1


class _FeedReader:
    """onnxruntime's CalibrationDataReader over recorded feeds, read one at a
    time (the feeds may live on disk: edge_build/quantize/feed_files.py)."""

    def __init__(self, feeds: Sequence[Feed], input_names: set[str]) -> None:
        self._feeds = feeds
        self._names = input_names
        self._i = 0
        self._end = len(feeds)

    def set_range(self, start_index: int, end_index: int) -> None:
        """The strided calibration's window of feeds."""
        self._i, self._end = start_index, min(end_index, len(self._feeds))

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._i >= self._end:
            return None
        self._i += 1
        return {k: v for k, v in self._feeds[self._i - 1].items() if k in self._names}

    def rewind(self) -> None:
        self._i, self._end = 0, len(self._feeds)

    def __len__(self) -> int:
        return len(self._feeds)


def quantize_int8(src: Path, dst: Path, feeds: Sequence[Feed], exclude: Sequence[str],
                  method: str = "minmax", ranges_cache: Path | None = None) -> None:
    """Write `dst`: `src` with Q/DQ around every MatMul/Gemm/Conv not in `exclude`.
    With `ranges_cache` the activation ranges are computed on the first call
    and read back from that file by later calls on the same graph (the
    sensitivity pass quantizes each graph many times with the same ranges)."""
    if method not in CALIBRATION_METHODS:
        raise ValueError(f"calibration method {method!r} is not one of {CALIBRATION_METHODS}")
    if not feeds:
        raise ValueError(f"no calibration feeds for {src.name}: the fp32 pipeline never ran this stage")
    model = onnx.load(str(src), load_external_data=False)
    names = {i.name for i in model.graph.input}
    big = src.stat().st_size + sum(p.stat().st_size for p in external_files(src, model)) > (1 << 30)
    # quantize_static writes a shape-inferred copy next to its input: work on a
    # link in our own directory so that the source bundle stays untouched.
    with tempfile.TemporaryDirectory(dir=dst.parent, prefix=".quantize-") as tmp:
        local = local_copy(src, model, Path(tmp))
        _quantize(local, dst, feeds, names, exclude, method, big, ranges_cache)


def local_copy(src: Path, model: onnx.ModelProto, directory: Path) -> Path:
    """`src` linked into `directory` with copies of its external data files (`model`: `src`
    loaded without its data). The data are copied: onnx refuses external data with several
    hard links (a bundle's shared llm_weights.bin has one per bundle `build quantize` linked
    it into) or a symlink."""
    local = directory / src.name
    _link(src, local)
    for data in external_files(src, model):
        shutil.copyfile(data, local.with_name(data.name))
    return local


def external_files(path: Path, model: onnx.ModelProto) -> list[Path]:
    """The external data files `model` (loaded from `path` without its data) refers to."""
    names = {e.value for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
             for e in t.external_data if e.key == "location"}
    return [path.with_name(n) for n in sorted(names)]


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _quantize(src: Path, dst: Path, feeds: Sequence[Feed], names: set[str], exclude: Sequence[str],
              method: str, big: bool, ranges_cache: Path | None) -> None:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    extra: dict[str, bool | float | int] = {
        "ActivationSymmetric": True, "WeightSymmetric": True,
        # TensorRT fuses fp32 biases itself; an int32 bias DQ buys nothing there.
        "QuantizeBias": False,
    }
    if method == "percentile":
        extra["CalibPercentile"] = 99.999
    else:
        extra["CalibStridedMinMax"] = CALIB_STRIDE
    quantize_static(
        str(src), str(dst), _FeedReader(feeds, names), quant_format=QuantFormat.QDQ,
        op_types_to_quantize=list(QUANT_OPS), per_channel=True, reduce_range=False,
        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, nodes_to_exclude=list(exclude),
        use_external_data_format=big,
        calibrate_method=CalibrationMethod.MinMax if method == "minmax" else CalibrationMethod.Percentile,
        extra_options=extra, calibration_cache_path=str(ranges_cache) if ranges_cache is not None else None,
    )
    log.info("quantized %s -> %s (%d nodes excluded)", src.name, dst.name, len(exclude))
