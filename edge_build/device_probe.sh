#!/usr/bin/env bash
# One short GPU lease: install the carried wheels (as device_bench.sh), build
# and export the full-size checkpoint, run the GPU tests, then
# edge_build/device_probe.py (stage times, onnxruntime profile per stage,
# the flow estimator with host arrays / IOBinding / CUDA graphs).
# Usage: edge_build/device_probe.sh OUTDIR
set -euo pipefail
out=${1:?usage: device_probe.sh OUTDIR}
mkdir -p "$out" /tmp/site
whl=/tmp/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
if ls /tmp/ort/part-* >/dev/null 2>&1; then cat /tmp/ort/part-* > "$whl"; fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl $( [ -f "$whl" ] && echo "$whl" )
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
t0=$(date +%s)
[ -f /tmp/full/ckpt/cosyvoice2.yaml ] || python3 -m daemon build tiny --size full --out /tmp/full/ckpt >"$out/build.log" 2>&1
[ -f /tmp/full/bundle/manifest.json ] || python3 -m daemon build export --model-dir /tmp/full/ckpt --out /tmp/full/bundle --static-decode-len "${STATIC_DECODE_LEN:-1536}" >>"$out/build.log" 2>&1
echo "build+export $(( $(date +%s) - t0 )) s"
[ -n "${SKIP_GPU_TESTS:-}" ] || python3 -m pytest -m gpu -q -p no:cacheprovider tests/models/test_graph_decode.py tests/models/test_flow_device_cache.py tests/models/test_ort_backend.py 2>&1 | grep -E "Error|passed|failed|FAILED|skipped" | tail -12 || true
timeout "${PROBE_TIMEOUT_S:-240}" python3 -m edge_build.device_probe --bundle /tmp/full/bundle --backend ort-cuda \
  --out "$out/probe" 2>&1 | grep -v -i "warn" | tail -120
