#!/usr/bin/env bash
# Benchmarks on a GPU machine without network (how the README's H200 figures
# were taken): the wheels that machine lacks are carried in .whl (and
# onnxruntime-gpu in parts under /tmp/ort, see README "Benchmarks"), the
# full-size checkpoint is built there, exported, and benchmarked with the CUDA
# provider against the official PyTorch pipeline on the same GPU.
# Usage: edge_build/tools/device_bench.sh OUTDIR [CONCURRENCY]
set -euo pipefail
out=${1:?usage: device_bench.sh OUTDIR [CONCURRENCY]}
conc=${2:-1,2,4}
source "$(dirname "$0")/device_setup.sh"
python3 -c "import onnxruntime as o, torch; print('onnxruntime', o.__version__, o.get_available_providers(), 'torch', torch.__version__)"
[ -n "${SKIP_GPU_TESTS:-}" ] || python3 -m pytest -m gpu -q -p no:cacheprovider tests/models/backends/test_graph_decode.py tests/models/backends/test_flow_device_cache.py tests/models/backends/test_ort_backend.py 2>&1 | grep -E "Error|passed|failed|FAILED|skipped" | tail -12 || true
timeout "${BENCH_TIMEOUT_S:-420}" python3 -m cosyedge_daemon -v bench --bundle /tmp/full/bundle --backend ort-cuda --repeats 1 --concurrency "$conc" \
  ${BENCH_ARGS:---reference} --json "$out/bench_h200.json" 2>&1 | grep -v -i warn | tee "$out/bench.log" | grep -E "INFO models.bench|Error|error" >&2 || { tail -40 "$out/bench.log"; exit 1; }
python3 - "$out/bench_h200.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print({k: r.get(k) for k in ("rtf", "streaming_rtf", "first_audio_ms", "stages_ms", "streaming_cost_vs_offline",
                             "speedup_vs_reference", "first_audio_vs_reference", "peak_rss_mb")})
print("reference", r.get("reference")); print("concurrency", r.get("concurrency"))
PY
