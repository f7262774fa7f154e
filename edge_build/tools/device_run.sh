#!/usr/bin/env bash
# The one script for a GPU machine without network (how the docs/gpu.md
# figures were taken on the device tool's H200). Before it, on a machine with
# network, in the repository root: edge_build/tools/device_wheels.sh (the wheels of
# edge_build/tools/device_wheels.txt into .whl/, onnxruntime-gpu in 52 MB parts under
# .device/ort/, pycuda's sdist under .device/pycuda/). Carry those to the GPU
# machine (a device call takes 64 MiB: one onnxruntime part a call into
# /tmp/ort, while the machine stays warm), then run there, in the repository:
#
#   edge_build/tools/device_run.sh OUTDIR [STEPS]
#
# STEPS (comma-separated, default tests,probe,bench; "setup" for the setup alone): the setup (wheels, the
# full-size checkpoint, its fp32 bundle with the fixed-size LLM step, the
# fixed-shape flow graphs and the fixed-length vocoder graphs, its fp16 bundle) always runs first, once per machine;
#   tests  every `pytest -m gpu` suite; the script FAILS when one fails
#   capmem what a CUDA session and a captured graph (per kernel, its intermediates) hold on the device
#          (edge_build/tools/capture_memory.py; runs with FULL=0)
#   probe  edge_build/tools/device_stream_probe.py (vocoder calls in the pipeline,
#          fixed-shape flow on/off) and edge_build/tools/device_probe.py
#   first  "the first chunk first" on and off (device_stream_probe.py --only-first-audio): one
#          stream and 8 at once on the fp32 bundle, with the saved voice VOICE_NAME where it is;
#          first audio, each first chunk's stage times and the graph thread's counters
#   profile onnxruntime's profile of one streaming synthesis with the saved voice, the fixed-shape
#          graphs run without capture: time per stage and operator type (models/tools/ort_profile.py)
#   batch  continuous batching: cosyedge bench with --graph-batching (the LLM steps of every running stream
#          in one replay, the fused fp16 graphs where the bundle has them) and --graph-flow-batch (the
#          streams' estimator windows in one replay), concurrency $CONCURRENCY (default 1,8,16): bench_h200_batch.json
#   conc   the batch step's concurrency levels without the batching flags: bench_h200_conc.json
#   lanes  one batched estimator replay of 1, 8, 16 streams in each lane variant made (bundle, lanes16, lanesf):
#          ms a replay, kernels and GPU ms a replay, the CUDA provider's nodes (lane_replay_h200.json)
#   bench16 the same concurrency levels on the fp16 bundle (--concurrency-only)
#   cloud  the cloud Triton model under load (python -m cosyedge_cloud.tools.loadtest): tritonserver (on PATH or
#          nvidia-pytriton in $COSYEDGE_TRITON_VENV) and mosquitto on this machine, the full bundle on ort-cuda,
#          KIND_GPU, Triton max_batch_size 16 (= the engine's LLM batch), at 1,4,8,16 concurrent requests:
#          cloud_h200.json (per level: req/s, first chunk and total percentiles, Triton's average batch and
#          the engine's llm_batch_max, the most requests that shared a decode step)
#   fp16   the fp16 bundle's fp32 and fp16 variants measured on ort-cuda and recorded in it
#          (python -m cosyedge_models.tools.precision_measure --write: with precision unset,
#          ort-cuda then loads the faster one), and its NaN/Inf check (fp16_check.json)
#   threads the fp32 bundle at each concurrency with a graph thread per stage (--graph-threads per-stage)
#   load   engine load time and device memory with the CUDA-graph stages off and on (their captures)
#   memory engine memory on ort-cuda (device and process): fp32 with the LLM weights
#          shared on the device and not, fp16 (python -m cosyedge_models.tools.engine_memory)
#   bench  cosyedge bench: fp32 with the fp16 bundle compared (where FP16=1 made it), concurrency
#          $CONCURRENCY (default 1,4,8,16), the official pipeline on the same GPU;
#          BENCH_ARGS=--graph-flow for the fixed-shape flow graphs (captured at load
#          on the engine's GPU graph thread, docs/gpu.md)
# Environment: WHEELS (default .whl), ORT_PARTS (/tmp/ort), PYCUDA_SDIST_DIR
# (.device/pycuda), FULL_DIR (/tmp/full), BENCH_ARGS (extra bench flags, e.g.
# --voice NAME), VOICE_WAV / VOICE_TEXT / VOICE_NAME (a recording, its transcript and the
# name it is saved under in both bundles, default en8), STATIC_FLOW_WINDOWS (64,128,640; set empty: none), STATIC_FLOW_CACHE (1024), VOCODER_FIRST_HOPS (15: the
# fixed-length vocoder graph of bench --first-chunk 15:6's first chunk), FUSED_BATCHES (1,2,4,8,16: the fused fp16 LLM step), BATCH_FLOW_SIZES
# (1,8: the batched estimator windows), BATCH_FLOW_PRECISION (fp32) and BATCH_FLOW_ATTENTION (plain): those
# windows' variant in the bundle itself (fp16 and fused: the fused lanes without a second export), EXPORT_JOBS
# (2: the flow and vocoder exported beside the LLM, build export --jobs; 1: one process),
# LANES16=1 (also /tmp/full/lanes16: the bundle with those in fp16, device_fp16.py --lanes-only), LANESF=1 (also /tmp/full/lanesf: those exported again in fp16 with onnxruntime's
# MultiHeadAttention, device_lanes.py), BUNDLE (the bench and batch steps' bundle under FULL_DIR: bundle, lanes16, lanesf;
# its name then suffixes their JSON), GPU_TESTS (a subset
# of the -m gpu test files, to repeat one), JSON_TAG (the bench, batch and cloud steps' JSON name suffix: two steps of one
# plan keep both files), CONCURRENCY, FP16=0 (no fp16 bundle: for steps
# that do not use it, when device time is short), FULL=0 (no full-size checkpoint or bundles at all:
# the tests step only, on the tests' own tiny bundles, in a minute or two).
set -euo pipefail
out=${1:?usage: device_run.sh OUTDIR [tests,probe,bench]}
steps=${2:-tests,probe,bench}
wheels=${WHEELS:-.whl}
full=${FULL_DIR:-/tmp/full}
mkdir -p "$out" /tmp/site
t0=$(date +%s)
stamp() { echo "[device_run +$(( $(date +%s) - t0 )) s] $*"; }

if [ ! -f /tmp/site/.cosyedge-installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$wheels"/*.whl
  # onnxruntime-gpu's files, as device_wheels.sh packed them (an xz tarball in parts)
  cat "${ORT_PARTS:-/tmp/ort}"/part-* | xz -d | tar x -C /tmp/site
  touch /tmp/site/.cosyedge-installed
fi
# the import names (cosyedge_daemon, …) of the folders, as pyproject's package-dir maps them
mkdir -p /tmp/src
for pair in cosyedge_daemon:daemon cosyedge_models:models cosyedge_build:edge_build cosyedge_cloud:cloud_bridge; do
  ln -sfn "$PWD/${pair#*:}" "/tmp/src/${pair%%:*}"
done
export PYTHONPATH=/tmp/site:/tmp/src:$PWD PYTHONUNBUFFERED=1
sdist=$(ls "${PYCUDA_SDIST_DIR:-.device/pycuda}"/pycuda-*.tar.gz 2>/dev/null | head -1 || true)
if [ -n "$sdist" ] && ! python3 -c "import pycuda" 2>/dev/null; then
  # built here against this machine's CUDA, beside the bundle build (CPU only)
  ( export PATH=/usr/local/cuda/bin:$PATH
    python3 -m pip wheel -q --no-deps --no-build-isolation -w /tmp/pycuda-wheel "$sdist" >"$out/pycuda.log" 2>&1 \
      && python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/pycuda-wheel/pycuda-*.whl \
      >>"$out/pycuda.log" 2>&1 ) &
  pycuda_build=$!
fi
python3 -c "import onnxruntime as o, torch; p = o.get_available_providers(); print('onnxruntime', o.__version__, p, \
'torch', torch.__version__); assert 'CUDAExecutionProvider' in p, 'no CUDA provider: onnxruntime-gpu missing'"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"

if [ "${FULL:-1}" = 0 ]; then
  steps_ok=1; for step in ${steps//,/ }; do case $step in tests|capmem) ;; *) steps_ok=0 ;; esac; done
  [ "$steps_ok" = 1 ] || { echo "FULL=0 (no full-size bundles) serves the tests and capmem steps only"; exit 2; }
  full=/nonexistent  # the -m gpu tests make their tiny bundles themselves
elif [ ! -f "$full/ckpt/cosyvoice2.yaml" ]; then
  python3 -m cosyedge_daemon build tiny --size full --out "$full/ckpt" >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
fi
if [ "${FULL:-1}" = 1 ] && [ ! -f "$full/bundle/manifest.json" ]; then
  python3 -m cosyedge_daemon build export --model-dir "$full/ckpt" --out "$full/bundle" --static-decode-len 1536 \
    --static-flow-windows "${STATIC_FLOW_WINDOWS-64,128,640}" --static-flow-cache "${STATIC_FLOW_CACHE:-1024}" --static-vocoder \
    --static-vocoder-first-hops "${VOCODER_FIRST_HOPS:-15}" --static-vocoder-hops "${VOCODER_HOPS:-50}" \
    --fused-decode-batches "${FUSED_BATCHES:-1,2,4,8,16}" --fused-decode-precision fp16 \
    --fused-prefill-lengths "${FUSED_PREFILL_LENGTHS:-}" \
    --batch-flow-sizes "${BATCH_FLOW_SIZES-1,8}" --batch-flow-precision "${BATCH_FLOW_PRECISION:-fp32}" \
    --batch-flow-attention "${BATCH_FLOW_ATTENTION:-plain}" --jobs "${EXPORT_JOBS:-2}" >>"$out/build.log" 2>&1 \
    || { tail -30 "$out/build.log"; exit 1; }
fi
if [ "${FULL:-1}" = 1 ] && [ "${FP16:-1}" = 1 ] && [ ! -f "$full/fp16/manifest.json" ]; then
  python3 -m cosyedge_build.tools.device_fp16 --bundle "$full/bundle" --out "$full/fp16" >>"$out/build.log" 2>&1 \
    || { tail -30 "$out/build.log"; exit 1; }
fi
if [ "${FULL:-1}" = 1 ] && [ -n "${VOICE_WAV:-}" ]; then
  # a saved zero-shot voice for `bench --voice` (BENCH_ARGS="--voice $VOICE_NAME"), in both bundles
  for b in "$full/bundle" "$full/fp16"; do
    [ -f "$b/manifest.json" ] || continue
    [ -f "$b/voices/${VOICE_NAME:-en8}.npz" ] || python3 -m cosyedge_daemon voice add --bundle "$b" --wav "$VOICE_WAV" \
      --text "${VOICE_TEXT:?VOICE_TEXT (the transcript of VOICE_WAV)}" "${VOICE_NAME:-en8}" >>"$out/build.log" 2>&1 \
      || { tail -20 "$out/build.log"; exit 1; }
  done
fi
if [ "${FULL:-1}" = 1 ] && [ "${LANES16:-0}" = 1 ] && [ ! -f "$full/lanes16/manifest.json" ]; then
  # the fp32 bundle (its voices too) with the batched estimator graphs in fp16: the fp16 lanes
  python3 -m cosyedge_build.tools.device_fp16 --bundle "$full/bundle" --out "$full/lanes16" --lanes-only \
    >>"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
fi
if [ "${FULL:-1}" = 1 ] && [ "${LANESF:-0}" = 1 ] && [ ! -f "$full/lanesf/manifest.json" ]; then
  # the batched estimator graphs exported again in fp16 with onnxruntime's MultiHeadAttention (the fused lanes)
  python3 -m cosyedge_build.tools.device_lanes --bundle "$full/bundle" --model-dir "$full/ckpt" --out "$full/lanesf" \
    --precision fp16 --attention fused >>"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
fi
if [ "${FULL:-1}" = 1 ]; then
  # the setup writes ~60 GB of graphs: their writeback must not share the host with the first bench (the
  # goals' bench right after the setup was 60-80 ms slower at eight streams than its level runs, twenty-fifth run)
  t_sync=$(date +%s); sync; echo "sync: $(( $(date +%s) - t_sync )) s"
fi
stamp "bundles ready"
if [ -n "${pycuda_build:-}" ]; then
  wait "$pycuda_build" || { echo "pycuda did not build (see pycuda.log); test_cuda_layer.py will skip"; tail -5 "$out/pycuda.log"; }
fi

# every test file with a gpu mark (found, not listed: a new -m gpu suite cannot be left out)
all_gpu_tests=$(grep -rlE "pytest\.mark\.gpu|mark\.gpu" tests --include="test_*.py" | sort | tr '\n' ' ')
for step in ${steps//,/ }; do
  case $step in
    tests)
      # every -m gpu suite; pipefail: a failed test fails the script
      python3 -m pytest -m gpu -q -rs -p no:cacheprovider ${GPU_TESTS:-$all_gpu_tests} \
        2>&1 | grep -v -i warn | tee "$out/gpu_tests.log" | tail -25
      stamp "gpu tests passed" ;;
    capmem)
      # what a CUDA session, a captured graph per kernel and its intermediates hold on the device (no bundle)
      python3 -m cosyedge_build.tools.capture_memory --out "$out/capture_memory.json" 2>&1 | tee "$out/capmem.log" | tail -12
      stamp "capmem done" ;;
    probe)
      timeout "${PROBE_TIMEOUT_S:-300}" python3 -m cosyedge_build.tools.device_stream_probe --bundle "$full/bundle" \
        --out "$out" --runs 2 2>&1 | grep -v -i warn | tee "$out/stream_probe.log" | grep -v " INFO " | tail -80
      stamp "probe done" ;;
    first)
      voice=()  # the saved voice, where the setup made it (VOICE_WAV, now or in an earlier call)
      [ -f "$full/bundle/voices/${VOICE_NAME:-en8}.npz" ] && voice=(--voice "${VOICE_NAME:-en8}")
      timeout "${PROBE_TIMEOUT_S:-300}" python3 -m cosyedge_build.tools.device_stream_probe --bundle "$full/bundle" \
        --out "$out/first" --runs 2 --only-first-audio --streams 8 ${voice[@]+"${voice[@]}"} 2>&1 \
        | grep -v -i warn | tee "$out/first_audio.log" | grep -v " INFO " | tail -60
      stamp "first-audio-first done" ;;
    bench)
      compare=()  # the fp16 bundle where the setup made it (FP16=0: none)
      [ -f "$full/fp16/manifest.json" ] && compare=(--compare "$full/fp16")
      timeout "${BENCH_TIMEOUT_S:-480}" python3 -m cosyedge_daemon -v bench --bundle "$full/${BUNDLE:-bundle}" --backend ort-cuda \
        --repeats 1 --concurrency "${CONCURRENCY:-1,4,8,16}" ${compare[@]+"${compare[@]}"} --reference ${BENCH_ARGS:-} \
        --json "$out/bench_h200${BUNDLE:+_$BUNDLE}${JSON_TAG:+_$JSON_TAG}.json" 2>&1 | grep -v -i warn > "$out/bench.log" \
        || { tail -40 "$out/bench.log"; exit 1; }
      python3 -m cosyedge_build.tools.device_summary "$out/bench_h200${BUNDLE:+_$BUNDLE}${JSON_TAG:+_$JSON_TAG}.json"
      stamp "bench done" ;;
    batch)
      timeout "${BENCH_TIMEOUT_S:-480}" python3 -m cosyedge_daemon -v bench --bundle "$full/${BUNDLE:-bundle}" --backend ort-cuda \
        --graph-batching --batching 16 --graph-flow-batch --concurrency "${CONCURRENCY:-1,8,16}" --concurrency-only \
        ${BENCH_ARGS:-} --json "$out/bench_h200_batch${BUNDLE:+_$BUNDLE}${JSON_TAG:+_$JSON_TAG}.json" 2>&1 | grep -v -i warn > "$out/batch.log" \
        || { tail -40 "$out/batch.log"; exit 1; }
      stamp "batch done" ;;
    conc)
      # the same concurrency-only run without the batching (one replay a stream), beside the batch step
      timeout "${BENCH_TIMEOUT_S:-480}" python3 -m cosyedge_daemon -v bench --bundle "$full/bundle" --backend ort-cuda \
        --concurrency "${CONCURRENCY:-1,8,16}" --concurrency-only ${BENCH_ARGS:-} \
        --json "$out/bench_h200_conc.json" 2>&1 | grep -v -i warn > "$out/conc.log" || { tail -40 "$out/conc.log"; exit 1; }
      stamp "conc done" ;;
    bench16)
      # the fp16 bundle's streams at each concurrency (the bench step compares it at concurrency 1)
      timeout "${BENCH_TIMEOUT_S:-480}" python3 -m cosyedge_daemon -v bench --bundle "$full/fp16" --backend ort-cuda \
        --concurrency "${CONCURRENCY:-1,4,8,16}" --concurrency-only ${BENCH_ARGS:-} \
        --json "$out/bench_h200_fp16.json" 2>&1 | grep -v -i warn > "$out/bench16.log" || { tail -40 "$out/bench16.log"; exit 1; }
      stamp "bench16 done" ;;
    cloud)
      # no tritonserver or mosquitto on the image: device_wheels.sh's .device/cloud/ (pytriton's server with the
      # Python 3.12 stub, numpy 1.26 for that stub (Triton 2.51's Python backend predates numpy 2), tritonclient,
      # mosquitto with its libraries), copied to $CLOUD_DIR
      cdir=${CLOUD_DIR:-/tmp/cloud}
      if [ -f "$cdir/triton.tar.xz" ] && [ ! -x "$cdir/venv/bin/python" ]; then
        # Triton's stub does not take PYTHONPATH: like .venv-triton, a venv whose site-packages hold numpy 1.26
        # first, then (a .pth) this script's packages, the project and the image's own packages
        python3 -m venv --without-pip "$cdir/venv" && mkdir -p "$cdir/bin"
        sp=$("$cdir/venv/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
        xz -dc "$cdir/triton.tar.xz" | tar x -C "$sp" && xz -dc "$cdir/mosquitto.tar.xz" | tar x -C "$cdir"
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$sp" "$cdir"/wheels/*.whl
        printf '%s\n' /tmp/site /tmp/src "$PWD" "$(python3 -c "import sysconfig; print(sysconfig.get_path('purelib'))")" \
          >"$sp/cosyedge-device.pth"
        printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/mosquitto/lib exec %s/mosquitto/mosquitto "$@"\n' "$cdir" "$cdir" >"$cdir/bin/mosquitto"
        chmod +x "$cdir/bin/mosquitto"
      fi
      PATH=$cdir/bin:$PATH COSYEDGE_TRITON_VENV=$cdir/venv PYTHONPATH= \
      timeout "${CLOUD_TIMEOUT_S:-540}" "$cdir/venv/bin/python" -m cosyedge_cloud.tools.loadtest --bundle "$full/bundle" --gpu \
        --engine-backend ort-cuda --max-batch-size 16 --queue-delay-us "${QUEUE_DELAY_US:-2000}" --max-in-flight 16 \
        --levels "${CONCURRENCY:-1,4,8,16}" --text "${CLOUD_TEXT:-Hello there, this is the cloud speaking.}" \
        ${CLOUD_PARAMS:+$(printf -- '--parameter %s ' $CLOUD_PARAMS)} \
        --json "$out/cloud_h200${JSON_TAG:+_$JSON_TAG}.json" 2>&1 | grep -v -i warn | tee "$out/cloud.log" | grep -v " INFO " | tail -20
      stamp "cloud load test done" ;;
    fp16)
      cp "$full/fp16/fp16_check.json" "$out/" 2>/dev/null || echo "no fp16_check.json (bundle made before the check)"
      timeout "${BENCH_TIMEOUT_S:-480}" python3 -m cosyedge_models.tools.precision_measure --bundle "$full/fp16" \
        --backend ort-cuda --repeats 3 --write >"$out/precision_h200.json" 2>"$out/precision.log" \
        || { tail -30 "$out/precision.log"; exit 1; }
      cp "$full/fp16/precision_speed.json" "$out/"
      stamp "fp16 measured" ;;
    threads)
      # the fp32 bundle's streams at each concurrency with a graph thread per stage
      # (graph_threads = per-stage), to set beside the bench step's one thread
      timeout "${BENCH_TIMEOUT_S:-480}" python3 -m cosyedge_daemon -v bench --bundle "$full/bundle" --backend ort-cuda \
        --concurrency "${CONCURRENCY:-1,4,8,16}" --concurrency-only --graph-threads per-stage ${BENCH_ARGS:-} \
        --json "$out/bench_h200_per_stage.json" 2>&1 | grep -v -i warn > "$out/threads.log" || { tail -40 "$out/threads.log"; exit 1; }
      stamp "threads done" ;;
    memory)
      # engine memory as the daemon loads it on ort-cuda (GPU accounting beside the process's):
      # fp32 with the LLM weights shared on the device and not, fp16 shared; fixed-shape flow off
      for run in "bundle 1" "bundle 0" "fp16 1"; do
        set -- $run
        COSYEDGE_ORT_SHARE_WEIGHTS=$2 python3 -m cosyedge_models.tools.engine_memory "$full/$1" --backend ort-cuda \
          --graph-decode on --graph-flow off --json "$out/memory_$1_share$2.json" >>"$out/memory.log" 2>&1 \
          || { tail -30 "$out/memory.log"; exit 1; }
      done
      stamp "memory done" ;;
    load)
      # what the CUDA-graph stages add to an engine's load (their captures) and to device memory:
      # the fp32 bundle with them all off, then as ort-cuda loads it by default
      for g in off auto; do
        python3 -m cosyedge_models.tools.engine_memory "$full/bundle" --backend ort-cuda --graph-decode "$g" \
          --graph-flow "$g" --graph-vocoder "$g" --json "$out/load_graphs_$g.json" >>"$out/load.log" 2>&1 \
          || { tail -30 "$out/load.log"; exit 1; }
      done
      stamp "load done" ;;
    profile)
      # where a fixed-shape flow step's time goes: one streaming synthesis with the saved voice,
      # the fixed-shape graphs run without capture (COSYEDGE_ORT_CUDA_GRAPH=0) so that onnxruntime's
      # profiler sees every node; the summary per stage and operator type (models/tools/ort_profile.py)
      rm -rf /tmp/prof
      COSYEDGE_ORT_CUDA_GRAPH=0 COSYEDGE_ORT_PROFILE=/tmp/prof timeout "${PROFILE_TIMEOUT_S:-300}" python3 -m cosyedge_daemon \
        synth --bundle "$full/bundle" --backend ort-cuda --stream --voice "${VOICE_NAME:-en8}" --out "$out/profile.wav" \
        "The quick brown fox jumps over the lazy dog near the river bank." >"$out/profile.log" 2>&1 \
        || { tail -30 "$out/profile.log"; exit 1; }
      python3 -m cosyedge_models.tools.ort_profile /tmp/prof --top 14 --json "$out/profile.json" | tee "$out/profile.txt"
      stamp "profile done" ;;
    lanes)
      # one batched replay of 1, 8, 16 streams, the lanes alone, in each lane variant the setup made
      # (edge_build/tools/device_lane_replay.py: ms a replay, kernels and GPU ms, the CUDA provider's nodes)
      variants=(); for b in bundle lanes16 lanesf; do [ -f "$full/$b/manifest.json" ] && variants+=(--bundle "$full/$b"); done
      timeout "${LANES_TIMEOUT_S:-420}" python3 -m cosyedge_build.tools.device_lane_replay "${variants[@]}" \
        --streams "${LANE_STREAMS:-1,8,16}" --out "$out/lane_replay_h200.json" 2>&1 | grep -v -i warn > "$out/lanes.log" \
        || { tail -30 "$out/lanes.log"; exit 1; }
      grep " INFO .*a replay" "$out/lanes.log" | tail -12
      stamp "lanes done" ;;
    setup) ;;  # the setup above only (bundles and the voice ready for other commands)
    *) echo "unknown step $step (setup, tests, probe, first, profile, bench, batch, conc, bench16, fp16, threads, memory, load, lanes)"; exit 2 ;;
  esac
done
