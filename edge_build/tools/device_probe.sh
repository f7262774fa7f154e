#!/usr/bin/env bash
# One short GPU lease: install the carried wheels (as device_bench.sh), build
# and export the full-size checkpoint, run the GPU tests, then
# edge_build/tools/device_probe.py (stage times, onnxruntime profile per stage,
# the flow estimator with host arrays / IOBinding / CUDA graphs).
# Usage: edge_build/tools/device_probe.sh OUTDIR
set -euo pipefail
out=${1:?usage: device_probe.sh OUTDIR}
source "$(dirname "$0")/device_setup.sh"
[ -n "${SKIP_GPU_TESTS:-}" ] || python3 -m pytest -m gpu -q -p no:cacheprovider tests/models/backends/test_graph_decode.py tests/models/backends/test_flow_device_cache.py tests/models/backends/test_ort_backend.py 2>&1 | grep -E "Error|passed|failed|FAILED|skipped" | tail -12 || true
timeout "${PROBE_TIMEOUT_S:-240}" python3 -m cosyedge_build.tools.device_probe --bundle /tmp/full/bundle --backend ort-cuda \
  --out "$out/probe" 2>&1 | grep -v -i "warn" | tail -120
