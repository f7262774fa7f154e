"""The trt tests of this folder run on the real TensorRT where it is importable, else on the
emulator (tests/support/trt_runtime.py)."""

from tests.support.trt_runtime import build_trt_bundle, trt_runtime

__all__ = ["build_trt_bundle", "trt_runtime"]
