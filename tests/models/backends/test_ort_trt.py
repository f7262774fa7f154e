"""`ort-trt`: onnxruntime's TensorRT execution provider. Its options are made
in one place from the manifest (pure logic, tested here against shapes worked
out by hand from the manifest's symbols); without the provider the backend
refuses, naming what to install."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import pytest
from cosyedge_models.backends.factory import create_backend
from cosyedge_models.backends.ort import OrtBackend
from cosyedge_models.backends.ort_trt import CACHE_DIR, PROVIDER, StageOptions, provider_options
from cosyedge_models.bundle.loader import load_bundle
from cosyedge_models.errors import BundleError
from cosyedge_models.synthesis.synthesizer import load_synthesizer

DECODE = {
    "profile": [{"B": [1, 1, 4], "P": [1, 256, 1535], "T": [1, 1, 1]},
                {"B": [1, 1, 4], "P": [0, 0, 256], "T": [1, 128, 512]}],
    "inputs": [{"name": "inputs_embeds", "shape": ["B", "T", 64]},
               {"name": "attention_mask", "shape": ["B", "P+T"]},
               {"name": "past_kv", "shape": [2, 2, "B", 2, "P", 16]}],
}


def _options(precision: str = "fp32", entry: dict | None = None, **kw: object) -> dict[str, str]:  # type: ignore[type-arg]
    stage = StageOptions("llm_decode", precision, entry or DECODE)
    return provider_options(stage, bundle_root=Path("/b"), device_id=kw.pop("device_id", 1),  # type: ignore[arg-type]
                            cuda_graph=bool(kw.pop("cuda_graph", False)))


def test_profiles_in_the_providers_format() -> None:
    o = _options()
    # profile 0 then profile 1, each input once per profile; P+T and B worked out by hand
    assert o["trt_profile_min_shapes"] == ("inputs_embeds:1x1x64,attention_mask:1x2,past_kv:2x2x1x2x1x16,"
                                           "inputs_embeds:1x1x64,attention_mask:1x1,past_kv:2x2x1x2x0x16")
    assert o["trt_profile_opt_shapes"] == ("inputs_embeds:1x1x64,attention_mask:1x257,past_kv:2x2x1x2x256x16,"
                                           "inputs_embeds:1x128x64,attention_mask:1x128,past_kv:2x2x1x2x0x16")
    assert o["trt_profile_max_shapes"] == ("inputs_embeds:4x1x64,attention_mask:4x1536,past_kv:2x2x4x2x1535x16,"
                                           "inputs_embeds:4x512x64,attention_mask:4x768,past_kv:2x2x4x2x256x16")


def test_caches_in_the_bundle_and_the_device() -> None:
    o = _options()
    assert o["trt_engine_cache_enable"] == o["trt_timing_cache_enable"] == "True"
    assert o["trt_engine_cache_path"] == o["trt_timing_cache_path"] == f"/b/{CACHE_DIR}"
    assert o["device_id"] == "1"


@pytest.mark.parametrize(("precision", "fp16", "int8"), [("fp32", "False", "False"), ("fp16", "True", "False"),
                                                          ("int8", "False", "True")])
def test_precision_from_the_stage(precision: str, fp16: str, int8: str) -> None:
    o = _options(precision)
    assert (o["trt_fp16_enable"], o["trt_int8_enable"]) == (fp16, int8)
    # INT8 comes from the graph's Q/DQ scales: no calibration table is named or read
    assert "trt_int8_calibration_table_name" not in o
    assert o.get("trt_int8_use_native_calibration_table", "False") == "False"
    assert ("trt_layer_norm_fp32_fallback" in o) == (precision == "fp16")


def test_int8w_is_refused() -> None:
    with pytest.raises(BundleError, match="not int8w"):
        _options("int8w")


def test_cuda_graph_where_asked() -> None:
    assert _options(cuda_graph=True)["trt_cuda_graph_enable"] == "True"
    assert _options()["trt_cuda_graph_enable"] == "False"


def test_static_stage_has_one_fixed_profile() -> None:
    entry = {"inputs": [{"name": "x", "shape": [2, 80, 100]}]}
    o = _options(entry=entry)
    assert o["trt_profile_min_shapes"] == o["trt_profile_max_shapes"] == "x:2x80x100"


def test_every_stage_of_the_tiny_bundle(tiny_bundle: Path) -> None:
    bundle = load_bundle(tiny_bundle)
    for name, info in bundle.stages.items():
        o = provider_options(StageOptions(name, info.precision, info.raw), bundle_root=bundle.root, device_id=0,
                             cuda_graph=False)
        inputs = [i["name"] for i in info.raw["inputs"]]
        listed = [item.split(":")[0] for item in o["trt_profile_min_shapes"].split(",")]
        assert set(listed) == set(inputs) and len(listed) % len(inputs) == 0, name


def test_backend_refuses_without_the_provider(tiny_bundle: Path) -> None:
    bundle = load_bundle(tiny_bundle)
    if PROVIDER in ort.get_available_providers():  # an onnxruntime that has it (a GPU machine)
        assert isinstance(create_backend("ort-trt", bundle=bundle), OrtBackend)
        return
    with pytest.raises(BundleError, match=f"{PROVIDER}.*onnxruntime-gpu") as err:
        create_backend("ort-trt", bundle=bundle)
    assert "CPUExecutionProvider" in str(err.value)  # what this onnxruntime has
    with pytest.raises(BundleError, match="onnxruntime-gpu"):
        load_synthesizer(tiny_bundle, "ort-trt")
