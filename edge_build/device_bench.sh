#!/usr/bin/env bash
# Benchmarks on a GPU machine without network (how the README's H200 figures
# were taken): the wheels that machine lacks are carried in .whl (and
# onnxruntime-gpu in parts under /tmp/ort, see README "Benchmarks"), the
# full-size checkpoint is built there, exported, and benchmarked with the CUDA
# provider against the official PyTorch pipeline on the same GPU.
# Usage: edge_build/device_bench.sh OUTDIR [CONCURRENCY]
set -euo pipefail
out=${1:?usage: device_bench.sh OUTDIR [CONCURRENCY]}
conc=${2:-1,2,4}
mkdir -p "$out" /tmp/site
whl=/tmp/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
if ls /tmp/ort/part-* >/dev/null 2>&1; then cat /tmp/ort/part-* > "$whl"; fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl $( [ -f "$whl" ] && echo "$whl" )
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c "import onnxruntime as o, torch; print('onnxruntime', o.__version__, o.get_available_providers(), 'torch', torch.__version__)"
t0=$(date +%s)
[ -f /tmp/full/ckpt/cosyvoice2.yaml ] || python3 -m daemon build tiny --size full --out /tmp/full/ckpt >"$out/build.log" 2>&1
[ -f /tmp/full/bundle/manifest.json ] || python3 -m daemon build export --model-dir /tmp/full/ckpt --out /tmp/full/bundle --static-decode-len "${STATIC_DECODE_LEN:-1536}" >>"$out/build.log" 2>&1
echo "build+export $(( $(date +%s) - t0 )) s"
[ -n "${SKIP_GPU_TESTS:-}" ] || python3 -m pytest -m gpu -q -p no:cacheprovider tests/models/test_graph_decode.py tests/models/test_flow_device_cache.py tests/models/test_ort_backend.py 2>&1 | grep -E "Error|passed|failed|FAILED|skipped" | tail -12 || true
timeout "${BENCH_TIMEOUT_S:-420}" python3 -m daemon -v bench --bundle /tmp/full/bundle --backend ort-cuda --repeats 1 --concurrency "$conc" \
  ${BENCH_ARGS:---reference} --json "$out/bench_h200.json" 2>&1 | grep -v -i warn | tee "$out/bench.log" | grep -E "INFO models.bench|Error|error" >&2 || { tail -40 "$out/bench.log"; exit 1; }
python3 - "$out/bench_h200.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print({k: r.get(k) for k in ("rtf", "streaming_rtf", "first_audio_ms", "stages_ms", "streaming_cost_vs_offline",
                             "speedup_vs_reference", "first_audio_vs_reference", "peak_rss_mb")})
print("reference", r.get("reference")); print("concurrency", r.get("concurrency"))
PY
