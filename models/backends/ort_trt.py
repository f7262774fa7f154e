"""`ort-trt`: onnxruntime's TensorRT execution provider, a second route to
TensorRT engines from the same bundle (NVIDIA's JetPack builds of
onnxruntime-gpu carry it). The provider builds its engines itself, from the
bundle's ONNX graphs, on the first session it creates, and keeps them (and
its timing cache) in the bundle's `ort-trt/` folder.

`provider_options` is the one place its options are made, from the
manifest's stage entry; pure logic, tested on the CPU. The options are those
of onnxruntime's TensorRT execution provider documentation
(https://onnxruntime.ai/docs/execution-providers/TensorRT-ExecutionProvider.html):

* trt_engine_cache_enable / trt_engine_cache_path, trt_timing_cache_enable /
  trt_timing_cache_path: in `<bundle>/ort-trt/`;
* trt_fp16_enable for an fp16 stage (its graph's casts; with
  trt_layer_norm_fp32_fallback, since the provider builds weakly typed
  networks that may move fp32 layers to fp16);
* trt_int8_enable for an INT8 stage: its graph is Q/DQ (explicit
  quantization), so no calibration table is named;
* trt_profile_min_shapes / opt / max: the manifest's optimization profiles,
  every profile one after another (an input repeated once per profile);
* trt_cuda_graph_enable for the fixed-shape stages, whose shapes never change
  (the provider captures one graph per session);
* device_id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosyedge_models.backends.profiles import ProfileShapes, all_input_ranges
from cosyedge_models.errors import BundleError

PROVIDER = "TensorrtExecutionProvider"
CACHE_DIR = "ort-trt"  # in the bundle: the provider's engines and timing cache
# The onnxruntime the provider comes with, for the message when it is missing.
INSTALL_HINT = ("onnxruntime-gpu with the TensorRT execution provider: on a Jetson, NVIDIA's build from the "
                "Jetson AI Lab pip index for your JetPack (with JetPack's TensorRT libraries); elsewhere "
                "onnxruntime-gpu and TensorRT 10 (pip install tensorrt-cu12 or the TensorRT tar/deb packages)")
PRECISIONS = ("fp32", "fp16", "int8")


def _flag(on: bool) -> str:
    return "True" if on else "False"


def profile_shapes(profiles: Sequence[ProfileShapes]) -> tuple[str, str, str]:
    """(min, opt, max) in the provider's format: `name:AxBxC,name2:...`, every
    profile after the other (the provider reads a repeated input as the next
    profile's). Static inputs are listed too: the provider needs every input
    of a profile once any is given."""
    def fmt(which: str) -> str:
        return ",".join(f"{name}:{'x'.join(str(d) for d in getattr(rng, which))}"
                        for prof in profiles for name, rng in prof.items())
    return fmt("min"), fmt("opt"), fmt("max")


@dataclass(frozen=True)
class StageOptions:
    """What provider_options needs of a stage (models.bundle.loader.StageInfo has it)."""

    name: str
    precision: str
    entry: Mapping[str, Any]


def provider_options(stage: StageOptions, *, bundle_root: Path, device_id: int, cuda_graph: bool) -> dict[str, str]:
    """The TensorRT execution provider's options for one stage of a bundle."""
    if stage.precision not in PRECISIONS:
        raise BundleError(f"{stage.name}: ort-trt builds TensorRT engines from fp32, fp16 or int8 (Q/DQ) graphs, "
                          f"not {stage.precision} (an onnxruntime-only format); use --precision int8 or fp16")
    cache = str(bundle_root / CACHE_DIR)
    low, opt, high = profile_shapes(all_input_ranges(stage.entry, stage.name))
    options = {
        "device_id": str(device_id),
        "trt_engine_cache_enable": _flag(True),
        "trt_engine_cache_path": cache,
        "trt_timing_cache_enable": _flag(True),
        "trt_timing_cache_path": cache,
        "trt_fp16_enable": _flag(stage.precision == "fp16"),
        "trt_int8_enable": _flag(stage.precision == "int8"),
        "trt_cuda_graph_enable": _flag(cuda_graph),
    }
    if stage.precision == "fp16":
        options["trt_layer_norm_fp32_fallback"] = _flag(True)
    if stage.precision == "int8":  # Q/DQ graphs carry their scales: no calibration table
        options["trt_int8_use_native_calibration_table"] = _flag(False)
    if low:
        options.update(trt_profile_min_shapes=low, trt_profile_opt_shapes=opt, trt_profile_max_shapes=high)
    return options


@dataclass(frozen=True)
class TrtStages:
    """A bundle's stages as the provider's options need them."""

    root: Path
    stages: Mapping[str, StageOptions]

    def stage(self, name: str) -> StageOptions:
        if name not in self.stages:
            raise BundleError(f"ort-trt: the bundle has no stage {name!r} (it has: {', '.join(self.stages)})")
        return self.stages[name]


def require_provider(available: Sequence[str]) -> None:
    """`ort-trt` refuses to start without the provider (rather than running on CUDA or the CPU unnoticed)."""
    if PROVIDER not in available:
        raise BundleError(f"backend ort-trt needs onnxruntime's {PROVIDER}, which this onnxruntime lacks "
                          f"(it has: {', '.join(available)}); install {INSTALL_HINT}, or use backend "
                          "\"trt\" (cosyedge build engines) or \"ort-cuda\"")
