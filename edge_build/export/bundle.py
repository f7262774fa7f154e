"""manifest.json: what models/bundle/BUNDLE.md specifies, with the sha256 of every
file, the stages' I/O and profiles, the hyper-parameters, the source
checkpoint's hashes and the build environment."""

from __future__ import annotations

import datetime as dt
import json
import platform
import shutil
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from cosyedge_build.export.graphs import OPSET, StageGraph, TensorSpec
from cosyedge_build.reference.modules import CARRIED_ONNX, require
from cosyedge_models.bundle.loader import sha256_file

FORMAT = "cosyedge-bundle"
FORMAT_VERSION = 2  # 2: the flow estimator takes and returns streaming caches
MANIFEST = "manifest.json"
# carried models: batch and frame ranges for their dynamic axes
_CARRIED_PROFILE = {"batch": [1, 1, 4], "frames": [10, 500, 3000]}  # 100 frames/s, 30 s max
_CARRIED_STAGES = {"campplus.onnx": "campplus", "speech_tokenizer_v2.onnx": "speech_tokenizer"}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def carry_onnx(model_dir: Path, out: Path) -> list[StageGraph]:
    """Copy campplus and the speech tokenizer as shipped; describe their I/O
    from the files (dynamic dims without a name get '<input>_<axis>')."""
    onnx = require("onnx", "onnx", "reading the carried ONNX models")
    stages = []
    for file in CARRIED_ONNX:
        shutil.copyfile(model_dir / file, out / file)
        model = onnx.load(str(out / file), load_external_data=False)
        initializers = {i.name for i in model.graph.initializer}
        profile: dict[str, list[int]] = {}

        def spec(value: Any, is_input: bool, profile: dict[str, list[int]] = profile) -> TensorSpec:
            dims: list[int | str] = []
            for axis, d in enumerate(value.type.tensor_type.shape.dim):
                if d.HasField("dim_value"):
                    dims.append(int(d.dim_value))
                    continue
                name = d.dim_param or f"{value.name}_{axis}"
                dims.append(name)
                if is_input:
                    profile.setdefault(name, _CARRIED_PROFILE["batch" if axis == 0 else "frames"])
            dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).name
            return TensorSpec(value.name, dtype, tuple(dims))

        inputs = [spec(v, True) for v in model.graph.input if v.name not in initializers]
        outputs = [spec(v, False) for v in model.graph.output]
        stages.append(
            StageGraph(_CARRIED_STAGES[file], file, inputs, outputs, profile, extra={"carried": True})
        )
    return stages


def stage_entry(out: Path, stage: StageGraph) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "file": stage.file,
        "sha256": sha256_file(out / stage.file),
        "precision": "fp32",
        "inputs": [s.as_dict() for s in stage.inputs],
        "outputs": [s.as_dict() for s in stage.outputs],
        "profile": stage.profile,
        **stage.extra,
    }
    if stage.external_data:
        entry["external_data"] = {
            "file": stage.external_data,
            "sha256": sha256_file(out / stage.external_data),
        }
    return entry


def _array_entry(out: Path, path: Path) -> dict[str, Any]:
    import numpy as np

    array = np.load(path, mmap_mode="r")
    return {
        "file": path.name,
        "sha256": sha256_file(path),
        "dtype": array.dtype.name,
        "shape": list(array.shape),
    }


def source_hashes(model_dir: Path) -> dict[str, str]:
    return {
        p.relative_to(model_dir).as_posix(): sha256_file(p)
        for p in sorted(model_dir.rglob("*"))
        if p.is_file()
    }


def build_info() -> dict[str, Any]:
    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "created": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": sys.version.split()[0],
        "cosyedge": _version("cosyedge"),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "onnx": _version("onnx"),
        "reference": {"package": "token2wav-cosyvoice", "version": _version("token2wav-cosyvoice")},
        "exporter": "torch.onnx.export (TorchScript, dynamo=False)",
        "onnx_opset": OPSET,
    }


def write_manifest(
    out: Path,
    *,
    model_dir: Path,
    hyper: dict[str, Any],
    stages: list[StageGraph],
    arrays: dict[str, Path],
    tokenizer: tuple[Path, dict[str, Any]],
    voices: dict[str, str],
) -> Path:
    tokenizer_path, tokenizer_info = tokenizer
    default_voice = "default" if "default" in voices else next(iter(voices), None)
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "family": "cosyvoice2",
        "cosyvoice_version": 2,
        "precision": "fp32",
        **hyper,
        "stages": {stage.name: stage_entry(out, stage) for stage in stages},
        "arrays": {key: _array_entry(out, path) for key, path in arrays.items()},
        "tokenizer": {"file": tokenizer_path.name, "sha256": sha256_file(tokenizer_path), **tokenizer_info},
        "voices": voices,
        "default_voice": default_voice,
        "files": {
            p.relative_to(out).as_posix(): sha256_file(p)
            for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != MANIFEST
        },
        "source": {"model_dir": str(model_dir.resolve()), "files": source_hashes(model_dir)},
        "build": build_info(),
        "engines": None,
    }
    path = out / MANIFEST
    path.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path
