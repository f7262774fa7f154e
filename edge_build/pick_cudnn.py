"""Prints the environment settings of the fastest cuDNN variant that
edge_build/device_probe.py measured for the streaming vocoder call, for
device_bench.sh: `eval "$(python -m edge_build.pick_cudnn OUT/probe/probe.json)"`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ENV = {
    "heuristic": "COSYEDGE_ORT_CUDNN_SEARCH=HEURISTIC",
    "heuristic_pad_nc1d": "COSYEDGE_ORT_CUDNN_SEARCH=HEURISTIC COSYEDGE_ORT_CONV1D_PAD_NC1D=1",
    "exhaustive": "COSYEDGE_ORT_CUDNN_SEARCH=EXHAUSTIVE",
    "exhaustive_pad_nc1d": "COSYEDGE_ORT_CUDNN_SEARCH=EXHAUSTIVE COSYEDGE_ORT_CONV1D_PAD_NC1D=1",
}


def pick(report: dict, key: str = "hift_decoder_56") -> str:
    timings = {k: v for k, v in report.get("conv_variants", {}).get(key, {}).items()
               if k in ENV and isinstance(v, (int, float))}
    return min(timings, key=lambda k: timings[k]) if timings else "heuristic"


def main(argv: list[str]) -> int:
    best = pick(json.loads(Path(argv[0]).read_text()))
    print(f"export {ENV[best]}; echo cuDNN variant: {best} >&2")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
