"""Fixtures for the build side: the second tiny checkpoint (other sizes,
another seed) and its bundle, and `checkpoint`, which runs a test once per
checkpoint so that no size can hide in the export code."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import _cached_dir, _code_hash

SECOND_SEED = 7


@dataclass
class Checkpoint:
    name: str
    model_dir: Path
    bundle: Path
    refs: Any  # cosyedge_build.reference.modules.ReferenceModels
    sessions: dict[str, Any] = field(default_factory=dict)

    def session(self, stage: str) -> Any:
        """An onnxruntime CPU session on one stage graph of the bundle."""
        if stage not in self.sessions:
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.intra_op_num_threads = 2
            self.sessions[stage] = ort.InferenceSession(
                str(self.bundle / f"{stage}.onnx"), options, providers=["CPUExecutionProvider"]
            )
        return self.sessions[stage]


@pytest.fixture(scope="session")
def tiny2_model_dir() -> Path:
    from cosyedge_build.checkpoint.tiny import build_tiny_checkpoint

    return _cached_dir(
        "tiny2-ckpt",
        _code_hash("edge_build"),
        lambda out: build_tiny_checkpoint(out, seed=SECOND_SEED, size="tiny2"),
    )


@pytest.fixture(scope="session")
def tiny2_bundle(tiny2_model_dir: Path) -> Path:
    from cosyedge_build.export import export_bundle

    return _cached_dir(
        "tiny2-bundle", _code_hash("edge_build", "models"), lambda out: export_bundle(tiny2_model_dir, out)
    )


_REFS: dict[str, Checkpoint] = {}


@pytest.fixture(scope="session", params=["tiny", "tiny2"])
def checkpoint(request: pytest.FixtureRequest) -> Checkpoint:
    from cosyedge_build.reference.modules import load_reference

    name = request.param
    if name not in _REFS:
        model_dir = request.getfixturevalue("tiny_model_dir" if name == "tiny" else "tiny2_model_dir")
        bundle = request.getfixturevalue("tiny_bundle" if name == "tiny" else "tiny2_bundle")
        _REFS[name] = Checkpoint(name, model_dir, bundle, load_reference(model_dir))
    return _REFS[name]
