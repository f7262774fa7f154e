# Sourced by the device_*.sh scripts (set -euo pipefail and $out set by them):
# installs the carried wheels (onnxruntime-gpu reassembled from /tmp/ort
# when present), builds the full-size checkpoint and exports its bundle with
# the fixed-size decode step, once per machine.
mkdir -p "$out" /tmp/site
whl=/tmp/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
if ls /tmp/ort/part-* >/dev/null 2>&1; then cat /tmp/ort/part-* > "$whl"; fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl $( [ -f "$whl" ] && echo "$whl" )
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
t0=$(date +%s)
[ -f /tmp/full/ckpt/cosyvoice2.yaml ] || python3 -m cosyedge_daemon build tiny --size full --out /tmp/full/ckpt >"$out/build.log" 2>&1
[ -f /tmp/full/bundle/manifest.json ] || python3 -m cosyedge_daemon build export --model-dir /tmp/full/ckpt \
  --out /tmp/full/bundle --static-decode-len "${STATIC_DECODE_LEN:-1536}" >>"$out/build.log" 2>&1
echo "build+export $(( $(date +%s) - t0 )) s"
