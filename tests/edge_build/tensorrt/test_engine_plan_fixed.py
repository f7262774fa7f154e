"""What `cosyedge build engines` builds for the fixed-shape stages, decided
without TensorRT (edge_build/tensorrt/engine_plan.py): which stages, their
one profile (min = opt = max, from the manifest's static input shapes), the
precision rule on their own graph, and the CLI's default of all stages."""

from __future__ import annotations

import argparse

import pytest
from cosyedge_build.tensorrt.engine_plan import build_profiles, engine_stages, is_fixed_shape, precision_mode
from cosyedge_build.tensorrt.engines import EngineBuildSettings
from cosyedge_daemon.cli.build_engines import add_engines_arguments
from cosyedge_models.bundle.loader import (
    FIXED_SHAPE_PREFIXES,
    STAGES,
    STATIC_ENCODER_PREFIX,
    STATIC_FLOW_PREFIX,
    STATIC_VOCODER_PREFIX,
)
from cosyedge_models.errors import BundleError
from onnx import TensorProto, helper

FIXED = [f"{STATIC_FLOW_PREFIX}64", f"{STATIC_VOCODER_PREFIX}58", f"{STATIC_ENCODER_PREFIX}25"]


def test_every_fixed_shape_family_is_built_by_default() -> None:
    assert all(is_fixed_shape(n) for n in FIXED) and not any(is_fixed_shape(s) for s in STAGES)
    assert set(FIXED_SHAPE_PREFIXES) == {STATIC_FLOW_PREFIX, STATIC_VOCODER_PREFIX, STATIC_ENCODER_PREFIX}
    available = [*STAGES, "llm_decode_static", "llm_kv_pad", *FIXED]
    assert engine_stages(None, available) == (*STAGES, *sorted(FIXED))  # not the onnxruntime-only decode step
    assert engine_stages(None, STAGES) == STAGES  # a bundle without them: as before
    assert engine_stages(["flow_estimator", FIXED[0]], available) == ("flow_estimator", FIXED[0])
    with pytest.raises(BundleError, match="unknown stages"):
        engine_stages([f"{STATIC_FLOW_PREFIX}999"], available)
    with pytest.raises(ValueError, match="unknown stages"):
        EngineBuildSettings(stages=("llm_decode_static",))
    assert EngineBuildSettings(stages=(FIXED[1],)).stages == (FIXED[1],)


def test_a_fixed_shape_stage_gets_one_static_profile() -> None:
    entry = {"file": f"{FIXED[0]}.onnx", "profile": {},
             "inputs": [{"name": "x", "shape": [2, 80, 64]}, {"name": "att_cache", "shape": [320, 2, 2, 2, 4, 8]},
                        {"name": "commit_index", "shape": [2]}]}
    (profile,) = build_profiles(entry, FIXED[0], None)
    assert {n: (r.min, r.opt, r.max) for n, r in profile.items()} == {
        "x": ((2, 80, 64),) * 3, "att_cache": ((320, 2, 2, 2, 4, 8),) * 3, "commit_index": ((2,),) * 3}


def test_the_precision_rule_applies_to_them_unchanged() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 80, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 80, 64])
    plain = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]))
    assert precision_mode(plain).strongly_typed and precision_mode(plain).carried_by == "fp32"
    half = helper.make_model(helper.make_graph([helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
                                                helper.make_node("Cast", ["h"], ["y"], to=TensorProto.FLOAT)],
                                               "g", [x], [y]))
    # an fp16 companion's engine: its types are the policy
    assert precision_mode(half).strongly_typed and precision_mode(half).carried_by == "fp16 casts"


def test_cli_builds_all_stages_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    import cosyedge_build.tensorrt.engines as engines
    from cosyedge_daemon.cli.build_engines import engines_command

    p = argparse.ArgumentParser()
    add_engines_arguments(p)
    captured: dict[str, EngineBuildSettings] = {}

    def fake_build(bundle: str, settings: EngineBuildSettings) -> dict[str, str]:
        captured["settings"] = settings
        return {"tensorrt": "10.3", "gpu": "Orin"}

    monkeypatch.setattr(engines, "build_engines", fake_build)
    assert engines_command(p.parse_args(["--bundle", "b"])) == 0
    assert captured["settings"].stages is None  # engine_stages: the six and every fixed-shape one
    engines_command(p.parse_args(["--bundle", "b", "--stages", f"flow_estimator,{FIXED[0]}"]))
    assert captured["settings"].stages == ("flow_estimator", FIXED[0])
