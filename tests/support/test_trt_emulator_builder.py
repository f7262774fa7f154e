"""The TensorRT emulator's builder rules, each against the documented behaviour it emulates
(docs/tensorrt-emulator.md lists the sources), and the version matrix 10.3 / 10.13 / 11."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.trt_emulator import RTX_4090, Emulation
from tests.support.trt_emulator import emulated_tensorrt as emulate
from tests.support.trt_emulator.samples import affine_model, build_plan

DYN = {"x": ((1, 1, 4), (1, 8, 4), (2, 16, 4))}
ALL_VERSIONS = ["10.3", "10.13", "11"]


def _network(emu: Emulation, onnx_path: Path, strongly_typed: bool = False) -> tuple[Any, Any, Any, Any]:
    trt = emu.tensorrt
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strongly_typed else 0
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    assert parser.parse_from_file(str(onnx_path))
    return builder, network, parser, builder.create_builder_config()


def _profile(builder: Any, shapes: dict[str, tuple[tuple[int, ...], ...]]) -> Any:
    p = builder.create_optimization_profile()
    for name, (lo, opt, hi) in shapes.items():
        p.set_shape(name, lo, opt, hi)
    return p


@pytest.mark.parametrize(("lo", "opt", "hi"), [((1, 9, 4), (1, 8, 4), (2, 16, 4)),  # min > opt
                                               ((1, 1, 4), (1, 8, 4), (2, 4, 4)),  # opt > max
                                               ((1, 1), (1, 8, 4), (2, 16, 4))])  # ranks differ
def test_set_shape_needs_min_le_opt_le_max(emulated_tensorrt: Emulation, lo: Any, opt: Any, hi: Any) -> None:
    profile = emulated_tensorrt.tensorrt.Builder(None).create_optimization_profile()
    with pytest.raises(ValueError):
        profile.set_shape("x", lo, opt, hi)


def test_dynamic_network_needs_a_profile_for_every_dynamic_input(emulated_tensorrt: Emulation,
                                                                  tmp_path: Path) -> None:
    onnx_path = affine_model(tmp_path / "a.onnx")
    builder, network, _, config = _network(emulated_tensorrt, onnx_path)
    assert builder.build_serialized_network(network, config) is None  # no profile at all
    assert any("no optimization profile" in m for m in emulated_tensorrt.errors_logged())
    builder, network, _, config = _network(emulated_tensorrt, onnx_path)
    config.add_optimization_profile(_profile(builder, DYN))
    assert builder.build_serialized_network(network, config) is not None


def test_static_dimension_must_be_fixed_in_the_profile(emulated_tensorrt: Emulation, tmp_path: Path) -> None:
    builder, network, _, config = _network(emulated_tensorrt, affine_model(tmp_path / "a.onnx"))
    config.add_optimization_profile(_profile(builder, {"x": ((1, 1, 2), (1, 8, 4), (2, 16, 4))}))  # last dim is 4
    assert builder.build_serialized_network(network, config) is None
    assert any("static in the network" in m for m in emulated_tensorrt.errors_logged())


def test_profile_naming_a_tensor_that_is_not_an_input_fails_the_build(emulated_tensorrt: Emulation,
                                                                       tmp_path: Path) -> None:
    builder, network, _, config = _network(emulated_tensorrt, affine_model(tmp_path / "a.onnx"))
    config.add_optimization_profile(_profile(builder, {**DYN, "nope": ((1,), (1,), (1,))}))
    assert builder.build_serialized_network(network, config) is None


@pytest.mark.parametrize("emulated_tensorrt", ["10.3", "10.13"], indirect=True)
def test_strongly_typed_network_refuses_precision_flags_and_layer_precision(emulated_tensorrt: Emulation,
                                                                            tmp_path: Path) -> None:
    trt = emulated_tensorrt.tensorrt
    onnx_path = affine_model(tmp_path / "a.onnx")
    builder, network, _, config = _network(emulated_tensorrt, onnx_path, strongly_typed=True)
    config.add_optimization_profile(_profile(builder, DYN))
    config.set_flag(trt.BuilderFlag.FP16)
    assert builder.build_serialized_network(network, config) is None
    builder, network, _, config = _network(emulated_tensorrt, onnx_path, strongly_typed=True)
    config.add_optimization_profile(_profile(builder, DYN))
    network.get_layer(0).precision = trt.float32
    assert builder.build_serialized_network(network, config) is None
    assert any("strongly typed" in m for m in emulated_tensorrt.errors_logged())
    # the strongly typed network itself builds
    builder, network, _, config = _network(emulated_tensorrt, onnx_path, strongly_typed=True)
    config.add_optimization_profile(_profile(builder, DYN))
    assert builder.build_serialized_network(network, config) is not None


@pytest.mark.parametrize("emulated_tensorrt", ALL_VERSIONS, indirect=True)
def test_weak_typing_api_by_version(emulated_tensorrt: Emulation, tmp_path: Path) -> None:
    trt, version = emulated_tensorrt.tensorrt, emulated_tensorrt.env.version
    onnx_path = affine_model(tmp_path / "a.onnx")
    builder, network, _, config = _network(emulated_tensorrt, onnx_path)
    config.add_optimization_profile(_profile(builder, DYN))
    if version == "11":
        for flag in ("INT8", "FP16", "OBEY_PRECISION_CONSTRAINTS"):
            assert not hasattr(trt.BuilderFlag, flag)
        with pytest.raises(AttributeError):
            network.get_layer(0).precision = trt.float32
        with pytest.raises(AttributeError):
            network.get_layer(0).set_output_type(0, trt.float32)
        assert builder.build_serialized_network(network, config) is not None
        return
    for flag in ("INT8", "FP16", "OBEY_PRECISION_CONSTRAINTS"):
        config.set_flag(getattr(trt.BuilderFlag, flag))
    network.get_layer(0).precision = trt.float32
    network.get_layer(0).set_output_type(0, trt.float32)
    assert builder.build_serialized_network(network, config) is not None
    deprecated = [m for sev, m in emulated_tensorrt.journal if sev == 2 and "deprecated" in m]
    assert bool(deprecated) == (version == "10.13")  # deprecated since 10.12


@pytest.mark.parametrize("emulated_tensorrt", ALL_VERSIONS, indirect=True)
def test_plan_runs_only_on_the_version_that_built_it(emulated_tensorrt: Emulation, tmp_path: Path) -> None:
    plan = build_plan(emulated_tensorrt.tensorrt, affine_model(tmp_path / "a.onnx"), [DYN])
    assert plan is not None
    runtime = emulated_tensorrt.tensorrt.Runtime(emulated_tensorrt.tensorrt.Logger())
    assert runtime.deserialize_cuda_engine(plan) is not None
    for other in ALL_VERSIONS:
        if other == emulated_tensorrt.env.version:
            continue
        with emulate(other) as emu:  # nested: restored to the fixture's on exit
            assert emu.tensorrt.Runtime(emu.tensorrt.Logger()).deserialize_cuda_engine(plan) is None
            assert any("not compatible with this version" in m for m in emu.errors_logged())


def test_timing_cache_from_another_device_is_not_set(tmp_path: Path) -> None:
    onnx_path = affine_model(tmp_path / "a.onnx")
    with emulate(gpu=RTX_4090) as emu:
        builder, network, _, config = _network(emu, onnx_path)
        foreign = bytes(config.create_timing_cache(b"").serialize())
    with emulate() as emu:
        builder, network, _, config = _network(emu, onnx_path)
        config.add_optimization_profile(_profile(builder, DYN))
        cache = config.create_timing_cache(foreign)
        assert config.set_timing_cache(cache, False) is False  # BuilderConfig.set_timing_cache
        assert config.set_timing_cache(cache, True) is True  # ignore_mismatch
        own = config.create_timing_cache(b"")
        assert config.set_timing_cache(own, False) is True
        before = bytes(own.serialize())
        assert builder.build_serialized_network(network, config) is not None
        assert bytes(own.serialize()) != before  # the build recorded its tactics


def test_fixed_shape_network_gets_static_output_shapes(emulated_tensorrt: Emulation, tmp_path: Path) -> None:
    plan = build_plan(emulated_tensorrt.tensorrt, affine_model(tmp_path / "s.onnx", dynamic=False))
    assert plan is not None
    engine = emulated_tensorrt.tensorrt.Runtime(None).deserialize_cuda_engine(plan)
    assert tuple(engine.get_tensor_shape("y")) == (1, 8, 3)
    assert engine.num_optimization_profiles == 1
    assert [tuple(d) for d in engine.get_tensor_profile_shape("x", 0)] == [(1, 8, 4)] * 3
    assert np.dtype(emulated_tensorrt.tensorrt.nptype(engine.get_tensor_dtype("y"))) == np.float32


@pytest.mark.parametrize("emulated_tensorrt", ALL_VERSIONS, indirect=True)
@pytest.mark.parametrize("kind", ["fp16", "qdq"])
def test_strongly_typed_precision_graphs_build_and_run_on_every_version(emulated_tensorrt: Emulation,
                                                                         tmp_path: Path, kind: str) -> None:
    """One build path for 10.3, 10.13 and 11: the precision is in the graph (casts, Q/DQ), no flags."""
    from cosyedge_models.backends.tensorrt.backend import TrtBackend

    from tests.support.trt_emulator.samples import affine_reference, precision_model

    plan = build_plan(emulated_tensorrt.tensorrt, precision_model(tmp_path / f"{kind}.onnx", kind), [DYN],
                      strongly_typed=True)
    assert plan is not None, emulated_tensorrt.errors_logged()
    (tmp_path / "p.plan").write_bytes(plan)
    session = TrtBackend().load("p", tmp_path / "p.plan")
    x = np.random.default_rng(3).uniform(-2, 2, (1, 6, 4)).astype(np.float32)
    got = session.run({"x": x})["y"]
    tol = 2e-2 if kind == "fp16" else 0.1  # what fp16 / int8 rounding of this graph allows
    np.testing.assert_allclose(got, affine_reference(x), atol=tol)
    assert not np.array_equal(got, affine_reference(x))  # the graph's own rounding is what runs
    session.close()
