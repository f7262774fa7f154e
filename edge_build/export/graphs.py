"""Exporting one stage graph to ONNX: the I/O spec every stage declares
(names, dtypes, symbolic shapes, optimisation profile), the exporter call,
and the checks that the written file matches the spec."""

from __future__ import annotations

import logging
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cosyedge_build.reference.modules import require

log = logging.getLogger(__name__)

OPSET = 17
# protobuf's hard limit: above it the weights go to one external data file
PROTO_LIMIT_BYTES = 2 * 1024**3 - 1
MASK_NEGATIVE = -1.0e9  # finite: fully masked padding rows stay finite (no NaN in caches)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: float32, int64
    shape: tuple[int | str, ...]  # str: a symbolic dimension or an expression of them ("P+1", "T*480")

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass
class StageGraph:
    """What the manifest records about one exported stage."""

    name: str
    file: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    # free symbolic dim -> [min, opt, max]; a list of such maps: several TensorRT profiles
    profile: dict[str, list[int]] | list[dict[str, list[int]]]
    external_data: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def module_base() -> Any:
    """torch.nn.Module, imported lazily (the export wrappers subclass it)."""
    return require("torch", "torch", "exporting ONNX graphs").nn.Module


def export_stage(module: Any, example: tuple[Any, ...], out_dir: Path, stage: StageGraph) -> StageGraph:
    """torch.onnx.export (TorchScript exporter: fast and reliable for these
    graphs) with the spec's names and dynamic axes; weights inside the file
    unless the model is over protobuf's 2 GB limit."""
    torch = require("torch", "torch", "exporting ONNX graphs")
    onnx = require("onnx", "onnx", "exporting ONNX graphs")
    path = out_dir / stage.file
    dynamic_axes = {
        spec.name: {i: str(d) for i, d in enumerate(spec.shape) if isinstance(d, str)}
        for spec in (*stage.inputs, *stage.outputs)
    }
    module.eval()
    # a scratch folder: above 2 GB the exporter writes one file per tensor
    with tempfile.TemporaryDirectory(dir=out_dir) as scratch:
        raw = Path(scratch) / stage.file
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the legacy exporter's deprecation and tracer notes
            torch.onnx.export(
                module,
                example,
                str(raw),
                input_names=[s.name for s in stage.inputs],
                output_names=[s.name for s in stage.outputs],
                dynamic_axes=dynamic_axes,
                opset_version=OPSET,
                do_constant_folding=True,
                dynamo=False,
            )
        model = onnx.load(str(raw), load_external_data=True)
    _name_dims(model, stage)
    _leave_out_unread_outputs(model)
    if model.ByteSize() > PROTO_LIMIT_BYTES:
        stage.external_data = f"{stage.file}.data"
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=stage.external_data,
            size_threshold=1024,
        )
    else:
        onnx.save_model(model, str(path))
    onnx.checker.check_model(str(path))
    log.info("exported %s (%.1f MB)", stage.file, path.stat().st_size / 1e6)
    return stage


def _leave_out_unread_outputs(model: Any) -> None:
    """An onnxruntime operator's optional outputs that nothing reads, left out ("" in the node): the
    exporter names every output of a custom symbolic (SkipLayerNormalization's mean and inv_std_var),
    and onnxruntime's CUDA kernels do not write those."""
    graph = model.graph
    read = {name for node in graph.node for name in node.input} | {v.name for v in graph.output}
    for node in graph.node:
        if node.domain == "com.microsoft":
            for i in range(1, len(node.output)):
                if node.output[i] not in read:
                    node.output[i] = ""


def _name_dims(model: Any, stage: StageGraph) -> None:
    """Write the spec's symbolic names into the graph's I/O (the exporter
    names output dims on its own) and check ranks and dtypes."""
    onnx = require("onnx", "onnx", "exporting ONNX graphs")
    declared = {s.name: s for s in (*stage.inputs, *stage.outputs)}
    values = list(model.graph.input) + list(model.graph.output)
    missing = set(declared) - {v.name for v in values}
    if missing:
        raise RuntimeError(f"{stage.file}: the exporter dropped {sorted(missing)} (unused in the graph?)")
    for value in values:
        spec = declared.get(value.name)
        if spec is None:
            continue
        dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).name
        dims = value.type.tensor_type.shape.dim
        if dtype != spec.dtype or len(dims) != len(spec.shape):
            raise RuntimeError(
                f"{stage.file}: {value.name} is {dtype}{len(dims)}d, spec says {spec.dtype} {spec.shape}"
            )
        for dim, want in zip(dims, spec.shape, strict=True):
            if isinstance(want, str):
                dim.dim_param = want
            elif dim.HasField("dim_value") and dim.dim_value != want:
                raise RuntimeError(
                    f"{stage.file}: {value.name} has {dim.dim_value} where the spec says {want}"
                )
            else:
                dim.dim_value = want
