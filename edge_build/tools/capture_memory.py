"""What onnxruntime's CUDA provider holds on the device per session and per captured CUDA graph
(device_run.sh's `capmem` step; docs/gpu.md, "What a captured graph holds").

The batched estimator lanes were sized from their caches alone (half the GPU) and ran an H100 80GB
out of memory while capturing (2026-12-05): the captures and the sessions were not counted. This
measures the three costs the sizing now counts, on synthetic graphs (numpy + onnx, no bundle):
- a session: a CUDA session made and run once (its cuBLAS/cuDNN handles and workspace);
- a captured graph per kernel: a chain of N Add nodes captured under G `gpu_graph_id`s, for several N;
- a captured graph's intermediate tensors: whether each graph id keeps its own copy of them.

    python -m cosyedge_build.tools.capture_memory --out capture_memory.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


def _chain_model(path: Path, nodes: int, values: int, conv: bool = False) -> None:
    """x -> (Add 1.0) x nodes -> y over `values` floats (each Add one kernel); `conv`: a Conv and a
    MatMul first, so the session creates cuDNN and cuBLAS handles."""
    import onnx
    from onnx import TensorProto, helper

    inits, graph_nodes = [], []
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    inits.append(one)
    prev = "x"
    if conv:
        side = int(np.sqrt(values))
        w = helper.make_tensor("w", TensorProto.FLOAT, [1, 1, 3, 3], np.ones(9, np.float32).tolist())
        m = helper.make_tensor("m", TensorProto.FLOAT, [side, side], np.eye(side, dtype=np.float32).ravel().tolist())
        inits += [w, m]
        shape = helper.make_tensor("shape", TensorProto.INT64, [4], [1, 1, side, side])
        back = helper.make_tensor("back", TensorProto.INT64, [1], [values])
        inits += [shape, back]
        graph_nodes += [helper.make_node("Reshape", ["x", "shape"], ["x4"]),
                        helper.make_node("Conv", ["x4", "w"], ["c"], pads=[1, 1, 1, 1]),
                        helper.make_node("MatMul", ["c", "m"], ["mm"]),
                        helper.make_node("Reshape", ["mm", "back"], ["flat"])]
        prev = "flat"
    for i in range(nodes):
        out = "y" if i == nodes - 1 else f"t{i}"
        graph_nodes.append(helper.make_node("Add", [prev, "one"], [out]))
        prev = out
    graph = helper.make_graph(graph_nodes, "chain",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [values])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [values])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(path))


def _used() -> int:
    from cosyedge_models.backends.gpu_probe import device_memory_used

    used = device_memory_used(0)
    if used is None:
        raise SystemExit("no GPU: this measures onnxruntime's CUDA provider")
    return used


def _session(path: Path, graph: bool) -> Any:
    import onnxruntime as ort
    from cosyedge_models.backends.ort import cudnn_options

    options = {"device_id": "0", **cudnn_options()}
    if graph:
        options["enable_cuda_graph"] = "1"
    return ort.InferenceSession(str(path), providers=[("CUDAExecutionProvider", options)])


def _bound(sess: Any, values: int) -> tuple[Any, list[Any]]:
    import onnxruntime as ort

    x = ort.OrtValue.ortvalue_from_numpy(np.zeros(values, np.float32), "cuda", 0)
    y = ort.OrtValue.ortvalue_from_numpy(np.zeros(values, np.float32), "cuda", 0)
    binding = sess.io_binding()
    binding.bind_ortvalue_input("x", x)
    binding.bind_ortvalue_output("y", y)
    return binding, [x, y]


def measure_sessions(root: Path, count: int) -> dict[str, Any]:
    """Device bytes a CUDA session adds, made and run once (with a Conv and a MatMul)."""
    path = root / "session.onnx"
    _chain_model(path, 4, 64 * 64, conv=True)
    keep, deltas = [], []
    for _ in range(count):
        before = _used()
        sess = _session(path, graph=False)
        sess.run(None, {"x": np.zeros(64 * 64, np.float32)})
        keep.append(sess)
        deltas.append(_used() - before)
    return {"sessions": count, "bytes_each": deltas, "median_bytes": int(np.median(deltas))}


def measure_captures(root: Path, nodes: int, graphs: int, values: int) -> dict[str, Any]:
    """Device bytes of `graphs` captured graph ids of one session over a chain of `nodes` Adds."""
    path = root / f"chain{nodes}_{values}.onnx"
    _chain_model(path, nodes, values)
    sess = _session(path, graph=True)
    binding, keep = _bound(sess, values)
    import onnxruntime as ort

    opts0 = ort.RunOptions()
    opts0.add_run_config_entry("gpu_graph_id", "1")
    for _ in range(3):  # the first id: the session's own first runs and capture
        sess.run_with_iobinding(binding, opts0)
    before, t0 = _used(), time.perf_counter()
    for g in range(2, graphs + 2):
        opts = ort.RunOptions()
        opts.add_run_config_entry("gpu_graph_id", str(g))
        for _ in range(3):
            sess.run_with_iobinding(binding, opts)
    grown = _used() - before
    del keep
    return {"nodes": nodes, "values": values, "graphs": graphs, "bytes": grown,
            "bytes_per_graph": grown / graphs, "bytes_per_node": grown / graphs / nodes,
            "capture_s_per_graph": (time.perf_counter() - t0) / graphs}


def measure_buffers(make: Callable[[int], Any], sizes_mb: tuple[int, ...]) -> tuple[list[dict[str, int]], list[Any]]:
    """Device bytes each buffer `make(nbytes)` gives takes, each held while the next is made: whether its
    allocator rounds a large buffer up (an OrtValue, as the lanes were; cuda.DriverBuffer, as since).
    The rows, and the buffers (the caller frees them)."""
    rows, kept = [], []
    for mb in sizes_mb:
        before = _used()
        kept.append(make(mb << 20))
        rows.append({"requested_bytes": mb << 20, "bytes": _used() - before})
    return rows, kept


def _ortvalue(nbytes: int) -> Any:
    import onnxruntime as ort

    return ort.OrtValue.ortvalue_from_numpy(np.zeros(nbytes // 4, np.float32), "cuda", 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file written")
    parser.add_argument("--graphs", type=int, default=24, help="graph ids captured per chain")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import onnxruntime as ort

    result: dict[str, Any] = {"tool": "cosyedge_build.tools.capture_memory", "onnxruntime": ort.__version__,
                              "host": platform.node(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    from cosyedge_models.backends.gpu_probe import probe_gpu

    result["gpu"] = probe_gpu().reason
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        from cosyedge_models.backends.cuda import DriverBuffer

        result["allocation"], values = measure_buffers(_ortvalue, (1500, 1500, 3000))
        del values
        result["driver_buffers"], buffers = measure_buffers(lambda n: DriverBuffer(n, 0), (1500, 1500, 3000))
        for buf in buffers:
            buf.close()
        log.info("driver buffers: %s", result["driver_buffers"])
        log.info("allocations: %s", result["allocation"])
        result["session"] = measure_sessions(root, 6)
        log.info("a session: %.1f MB", result["session"]["median_bytes"] / 1e6)
        result["chains"] = []
        for nodes in (256, 1024, 4096):
            row = measure_captures(root, nodes, args.graphs, 4096)
            result["chains"].append(row)
            log.info("%d nodes: %.2f MB a graph (%.0f B a node), %.3f s a capture", nodes,
                     row["bytes_per_graph"] / 1e6, row["bytes_per_node"], row["capture_s_per_graph"])
        # 8 Adds over 32 MB tensors: ~7 intermediates of 32 MB; per graph id or shared?
        big = measure_captures(root, 8, 8, 8 << 20)
        big["intermediate_bytes"] = 7 * (8 << 20) * 4
        result["intermediates"] = big
        log.info("intermediates: %.1f MB a graph for %.1f MB of intermediates", big["bytes_per_graph"] / 1e6,
                 big["intermediate_bytes"] / 1e6)
    slope = np.polyfit([r["nodes"] for r in result["chains"]], [r["bytes_per_graph"] for r in result["chains"]], 1)
    result["fit"] = {"bytes_per_node": float(slope[0]), "bytes_per_graph_fixed": float(slope[1])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["fit"]), result["session"]["median_bytes"], result["intermediates"]["bytes_per_graph"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
