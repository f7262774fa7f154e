"""One copy of the LLM weights for every LLM graph of a bundle.

`llm_prefill`, `llm_decode` and the fixed-size `llm_decode_static` are three
graphs over the same layers (the exporter names their folded weights
differently, but the bytes are equal). This pass writes each distinct weight
tensor once into one data file (`llm_weights.bin`, every tensor at a 64 KiB
aligned offset, so onnxruntime can map it), points the graphs' initializers
at it as ONNX external data under one shared name, and writes the index
(`llm_weights.json`, models/backends/shared_weights.py reads it): the
runtime then hands the same buffers to every LLM session, and a tool that
reads ONNX (onnxruntime, TensorRT's parser, onnx) still sees ordinary graphs.
Reads one tensor at a time (the graphs are 1.45 GB each at full size)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cosyedge_build.reference.modules import require
from cosyedge_models.backends.shared_weights import ALIGN, INDEX_FORMAT, MIN_SHARED_BYTES

log = logging.getLogger(__name__)

SHARED_LLM_FILE = "llm_weights.bin"
# the fused step's and fixed-length prefill graphs' one copy (their fp16 weights are not the plain graphs')
SHARED_FUSED_FILE = "llm_weights.fused.bin"
LLM_STAGES = ("llm_prefill", "llm_decode", "llm_decode_static")


def _onnx() -> Any:
    return require("onnx", "onnx", "sharing the LLM weights")


def _tensor_bytes(root: Path, tensor: Any) -> bytes:
    """The raw little-endian bytes of an initializer, inline or external."""
    onnx = _onnx()
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        info = {e.key: e.value for e in tensor.external_data}
        with (root / info["location"]).open("rb") as f:
            f.seek(int(info.get("offset", 0)))
            return f.read(int(info["length"])) if "length" in info else f.read()
    if tensor.HasField("raw_data"):
        return bytes(tensor.raw_data)
    from onnx import numpy_helper

    return numpy_helper.to_array(tensor).tobytes()


def _has_subgraphs(graph: Any) -> bool:
    onnx = _onnx()
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node
               for a in n.attribute)


def share_weights(root: Path, graphs: Sequence[str], data_file: str) -> dict[str, Any]:
    """Rewrite root/<graphs> so that their weights live once in root/<data_file>;
    writes the index `<data_file stem>.json` beside it and returns it. Old
    `<graph>.data` files of these graphs are removed."""
    onnx = _onnx()
    from onnx import helper

    root = Path(root)
    data_path = root / data_file
    tmp = data_path.with_name(data_path.name + ".partial")
    tensors: dict[str, dict[str, Any]] = {}
    by_key: dict[tuple[int, tuple[int, ...], str], str] = {}
    old_data: set[Path] = set()
    models = {}
    offset = 0
    with tmp.open("wb") as out:
        for name in graphs:
            model = onnx.load(str(root / name), load_external_data=False)
            if _has_subgraphs(model.graph):
                raise ValueError(f"{name}: graphs with subgraphs are not supported here")
            renames: dict[str, str] = {}
            for t in model.graph.initializer:
                if t.data_location == onnx.TensorProto.EXTERNAL:
                    old_data.add(root / {e.key: e.value for e in t.external_data}["location"])
                data = _tensor_bytes(root, t)
                if len(data) < MIN_SHARED_BYTES:
                    if t.data_location == onnx.TensorProto.EXTERNAL:  # small: back inline
                        del t.external_data[:]
                        t.data_location = onnx.TensorProto.DEFAULT
                        t.raw_data = data
                    continue
                key = (int(t.data_type), tuple(int(d) for d in t.dims), hashlib.sha256(data).hexdigest())
                shared = by_key.get(key)
                if shared is None:
                    shared = t.name if t.name not in tensors else f"{t.name}.{key[2][:12]}"
                    pad = -offset % ALIGN
                    out.write(b"\0" * pad)
                    offset += pad
                    tensors[shared] = {"offset": offset, "nbytes": len(data), "data_type": key[0],
                                       "dtype": helper.tensor_dtype_to_np_dtype(key[0]).name, "shape": list(key[1])}
                    out.write(data)
                    offset += len(data)
                    by_key[key] = shared
                if shared != t.name:
                    renames[t.name] = shared
                t.name = shared
                # every value field: a tensor with external data may hold no other (ONNX's checker
                # and TensorRT's parser refuse it; the quantizer writes zero points as int32_data)
                for value_field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data",
                                    "uint64_data", "string_data"):
                    t.ClearField(value_field)
                del t.external_data[:]
                t.data_location = onnx.TensorProto.EXTERNAL
                for k, v in (("location", data_file), ("offset", str(tensors[shared]["offset"])),
                             ("length", str(tensors[shared]["nbytes"]))):
                    entry = t.external_data.add()
                    entry.key, entry.value = k, v
            for node in model.graph.node:
                for i, inp in enumerate(node.input):
                    if inp in renames:
                        node.input[i] = renames[inp]
            for vi in model.graph.input:
                if vi.name in renames:
                    vi.name = renames[vi.name]
            models[name] = model
    tmp.replace(data_path)
    for name, model in models.items():
        onnx.save(model, str(root / name))  # no raw data left: small files
    for path in old_data - {data_path}:
        path.unlink(missing_ok=True)
    index = {"format": INDEX_FORMAT, "file": data_file, "graphs": list(graphs), "bytes": offset,
             "tensors": tensors}
    index_path = data_path.with_suffix(".json")
    index_path.write_text(json.dumps(index, indent=1) + "\n")
    log.info("%s: %d weight tensors (%.1f MB) shared by %s", data_file, len(tensors), offset / 1e6,
             ", ".join(graphs))
    return index


def share_llm_files(root: Path, files: Mapping[str, Path], data_file: str) -> dict[str, Any] | None:
    """share_weights over the LLM graphs among `files` (stage -> graph written under
    `root`, e.g. a quantized bundle's); None when fewer than two of them are there."""
    names = [p.name for stage, p in files.items() if stage in LLM_STAGES]
    return share_weights(root, names, data_file) if len(names) >= 2 else None


def share_stages(root: Path, stages: Sequence[Any], data_file: str) -> dict[str, Any] | None:
    """share_weights over these stage graphs (StageGraph), marking each stage
    entry with the data file (`shared_weights`) instead of its own external
    data. None when fewer than two graphs are given."""
    if len(stages) < 2:
        return None
    index = share_weights(root, [s.file for s in stages], data_file)
    for s in stages:
        s.external_data = None
        s.extra["shared_weights"] = {"file": data_file, "index": Path(data_file).with_suffix(".json").name}
    return index


def share_llm_stages(root: Path, stages: Sequence[Any], data_file: str = SHARED_LLM_FILE) -> dict[str, Any] | None:
    """share_stages over the bundle's plain LLM stage graphs. None when fewer than two exist."""
    return share_stages(root, [s for s in stages if s.name in LLM_STAGES], data_file)
