"""`build engines`' options and refusals under the TensorRT emulator: a partial rebuild keeps the
other stages' plans, --max-batch caps the profiles, the board is guessed from a Jetson's memory, and
bad input (unknown stages, a broken ONNX file, a build of some stages only) gets a clear error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cosyedge_build.tensorrt.engines import EngineBuildSettings, build_engines, guess_board
from cosyedge_models.bundle.memory_budget import BOARDS
from cosyedge_models.errors import BundleError, SynthesisError

from tests.support.trt_emulator import JETSON_ORIN_NANO, Emulation


def _copy(bundle: Path, tmp_path: Path) -> Path:
    root = tmp_path / "bundle"
    shutil.copytree(bundle, root)
    return root


def test_partial_rebuild_keeps_the_other_plans(emulated_tensorrt: Emulation, tiny_bundle: Path,
                                               tmp_path: Path) -> None:
    root = _copy(tiny_bundle, tmp_path)
    lines: list[str] = []
    first = build_engines(root, EngineBuildSettings(workspace_mib=64), progress=lines.append)
    # the emulated GPU is an Orin Nano 8 GB: the board is guessed and its memory budget printed
    assert first["board"] == guess_board(JETSON_ORIN_NANO.name, JETSON_ORIN_NANO.total_memory_bytes) is not None
    assert any(line.startswith("memory on ") for line in lines)
    again = build_engines(root, EngineBuildSettings(workspace_mib=64, stages=("hift_decoder",)),
                          progress=lambda _line: None)
    for stage, rec in first["stages"].items():
        if stage != "hift_decoder":
            assert again["stages"][stage] == rec, stage  # kept as they were
    assert json.loads((root / "manifest.json").read_text())["engines"] == again


def test_max_batch_caps_the_profiles(emulated_tensorrt: Emulation, tiny_bundle: Path, tmp_path: Path) -> None:
    root = _copy(tiny_bundle, tmp_path)
    built = build_engines(root, EngineBuildSettings(workspace_mib=64, max_batch=1), progress=lambda _line: None)
    for stage, rec in built["stages"].items():
        for prof in rec["profiles"]:
            for name, (_lo, _opt, hi) in prof.items():
                if name in ("inputs_embeds", "token", "mel"):
                    assert hi[0] == 1, (stage, name, hi)
                if name == "x" and stage == "flow_estimator":
                    assert hi[0] == 2, (stage, hi)  # N = 2 x requests (classifier-free guidance)


def test_some_stages_only_is_refused_without_earlier_engines(emulated_tensorrt: Emulation, tiny_bundle: Path,
                                                             tmp_path: Path) -> None:
    root = _copy(tiny_bundle, tmp_path)
    with pytest.raises(BundleError, match="engines are missing for"):
        build_engines(root, EngineBuildSettings(workspace_mib=64, stages=("hift_decoder",)),
                      progress=lambda _line: None)


def test_a_broken_onnx_file_names_the_parser(emulated_tensorrt: Emulation, tiny_bundle: Path,
                                             tmp_path: Path) -> None:
    root = _copy(tiny_bundle, tmp_path)
    manifest = json.loads((root / "manifest.json").read_text())
    path = root / manifest["stages"]["hift_decoder"]["file"]
    path.write_bytes(b"not an onnx graph")
    with pytest.raises((SynthesisError, BundleError), match="hift_decoder"):
        build_engines(root, EngineBuildSettings(workspace_mib=64, stages=("hift_decoder",)),
                      progress=lambda _line: None)


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown stages"):
        EngineBuildSettings(stages=("nope",))
    with pytest.raises(ValueError, match="max_batch"):
        EngineBuildSettings(max_batch=0)
    with pytest.raises(ValueError, match="unknown board"):
        EngineBuildSettings(board="orin-huge")


def test_guess_board_by_memory() -> None:
    smallest = min(BOARDS.values(), key=lambda b: b.usable_bytes)
    key = next(k for k, b in BOARDS.items() if b is smallest)
    assert guess_board("Orin", smallest.usable_bytes) == key
    assert guess_board("NVIDIA H200", smallest.usable_bytes) is None  # not a Jetson
    assert guess_board("Orin", 10 * max(b.usable_bytes for b in BOARDS.values())) is None
