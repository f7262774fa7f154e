"""The fp16 build's overflow check: every output of every fp16 stage graph on every
calibration input is finite (fp16 overflow shows as Inf, then NaN). `build quantize
--precision fp16` runs it on the CPU and refuses a graph that fails;
`edge_build/tools/device_fp16.py` runs it on the provider the bundle is for (CUDA,
where the fp16 kernels really run in half precision) and writes the result into the
bundle (FINITE_CHECK_FILE). Each stage's entry also says which ops the graph computes
in fp32 and how many Casts it has (fp16.precision_summary)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from cosyedge_build.quantize.fp16 import precision_summary

FINITE_CHECK_FILE = "fp16_check.json"

Feed = Mapping[str, np.ndarray]


def finite_check(graphs: Mapping[str, Path], feeds: Mapping[str, Sequence[Feed]],
                 providers: Sequence[str] = ("CPUExecutionProvider",)) -> dict[str, Any]:
    """Run each graph on its stage's feeds with `providers`; per stage: inputs run, how
    many gave a non-finite value, in which outputs, and the graph's precision summary.
    `ok` is False when a stage had no feeds or any non-finite value."""
    import onnxruntime as ort

    stages: dict[str, Any] = {}
    for stage, path in graphs.items():
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        sess = ort.InferenceSession(str(path), sess_options=opts, providers=list(providers))
        # fp16 I/O (fp16.FP16_IO) gets the captured fp32 feeds cast, as the runtime keeps them in fp16
        types = {i.name: (np.float16 if i.type == "tensor(float16)" else None) for i in sess.get_inputs()}
        names = [o.name for o in sess.get_outputs()]
        bad_inputs = 0
        bad_outputs: set[str] = set()
        runs = feeds.get(stage, ())
        for feed in runs:
            values = sess.run(None, {k: (v.astype(t) if (t := types[k]) is not None else v)
                                     for k, v in feed.items() if k in types})
            bad = [n for n, v in zip(names, values, strict=True)
                   if np.issubdtype(np.asarray(v).dtype, np.floating) and not np.isfinite(v).all()]
            bad_inputs += bool(bad)
            bad_outputs.update(bad)
        stages[stage] = {"inputs": len(runs), "nonfinite_inputs": bad_inputs, "nonfinite_outputs": sorted(bad_outputs),
                         "provider": sess.get_providers()[0],
                         **precision_summary(onnx.load(str(path), load_external_data=False))}
    ok = all(s["inputs"] > 0 and s["nonfinite_inputs"] == 0 for s in stages.values())
    return {"ok": ok, "providers": list(providers), "stages": stages}


def failures(check: Mapping[str, Any]) -> list[str]:
    """One line per stage that failed the check."""
    out = []
    for stage, s in check["stages"].items():
        if s["inputs"] == 0:
            out.append(f"{stage}: no calibration inputs reached it")
        elif s["nonfinite_inputs"]:
            out.append(f"{stage}: NaN/Inf on {s['nonfinite_inputs']} of {s['inputs']} calibration inputs "
                       f"(outputs {', '.join(s['nonfinite_outputs'])})")
    return out
