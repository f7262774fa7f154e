#!/usr/bin/env bash
# One H200 lease as a detached plan: device_run.sh's steps one after another
# under setsid, so that the device tool's 10-minute limit per call does not cut
# the setup or a bench; later calls only wait and collect (docs/gpu.md, "How to
# repeat"). Run from the repository root on the GPU machine, with onnxruntime-gpu's
# parts in /tmp/ort and the voice recording at $VOICE_WAV:
#   edge_build/tools/device_plan.sh start     copies the tree to /tmp/repo, starts the plan
#   edge_build/tools/device_plan.sh wait N    waits up to N s, prints progress; copies results to $OUT
#                                             (exits 3 at once on a fresh machine, where no plan runs)
# TESTS_BESIDE: test files (space-separated; default none) run as the tests step beside the plan's setup, e.g.
# the batched lanes' -m gpu tests: "tests/models/batching/test_flow_batcher_gpu.py tests/models/batching/
# test_batched_vocoder.py". Beside `build export --jobs 2` they doubled the setup (809 s against 387 s,
# twenty-fourth run), so a lease with benches to run leaves them out.
# PLAN (default below): "outdir steps [VAR=value ...]" entries separated by ";", "+" for a space in a value;
# STEPS="d x e": only those entries, in that order.
set -uo pipefail
res=${PLAN_DIR:-/tmp/r}  # PLAN_DIR, PLAN_REPO, PLAN_RUNNER: elsewhere (the tests)
repo=${PLAN_REPO:-/tmp/repo}; runner=${PLAN_RUNNER:-edge_build/tools/device_run.sh}
case ${1:?start or wait} in
  start)
    rm -rf "$repo" "$res" && mkdir -p "$repo" "$res" && cp -a . "$repo"/
    # default: issue 23's next measurements (the goals are stated for an H200; the twenty-second to
    # twenty-ninth runs got H100s): the goals' configuration as levels (x) right after the synced setup, and
    # the goals' bench with the official pipeline and the batched vocoder lengths (e): a voice's seeds that
    # find their lanes fresh now take them on the stream's thread, with no graph-thread turn (lanes.py; in the
    # twenty-ninth run such turns wrote nothing and still held the thread 15.6 ms at eight streams and 110.8
    # ms at sixteen, their Python waiting for the GIL), and the encoder lanes are refreshed too (their seeds
    # took 7.2 ms at eight, before the first prefill), and a batched stream's tokens come a chunk at a time,
    # with no producer thread (mailbox.py; llm_handovers: the gap between the LLM steps, ~1.5 ms beyond their
    # GPU work at eight streams in the twenty-ninth run); the bench of b's configuration with no single-stream
    # overflow slots (n: 16 lanes on an 80 GB card beside the long utterance's room); later chunks' flow
    # gathered 150 ms (graph_flow_gather_ms) in the goals' levels (a) and in n's configuration as levels (j);
    # the hop growing to 50 tokens after the first chunk (--hop-scale 2 --max-hop-tokens 50: every later chunk
    # on the 128-frame windows and the setup's 108-frame vocoder graph, half the later chunks' replays) in the
    # goals' levels (l) and in n's configuration (u), with later chunks' flow gathered 150 ms too (z), and on
    # per-stage threads (r: the best rate at sixteen so far on an H200): the rate at sixteen and the offline RTF
    # (the offline levels traced since 2026-12-08);
    # Python's thread switch interval at 0.5 ms instead of 5 in the goals' levels (w) and in n's (m): how
    # much of the idle between the batched LLM steps (38 ms at eight streams) and of the turns' waits is the
    # GIL; the goals' levels at 15 tokens and 6 Euler steps (s); the cloud at full size (c, CLOUD_PARAMS) and
    # without the batched encoder windows and overflow slots (k: 16 lanes on an 80 GB card), k's with the hop
    # capped at 50 (i: STREAM_HOP_SCALE, STREAM_MAX_HOP_TOKENS); t: the captured
    # fp16 prefill's -m gpu tests; then the candidates for the defaults: the batched vocoder lengths (v), the
    # batched prefill without the batched encoder windows (b: 8 lanes and 2 slots on an 80 GB card since the
    # long stream's room), rounds gathered 4 ms (g, h), per-stage threads (p, q), and the goals' levels again
    # (y). Every level (offline too) records the graph thread's trace (graph_trace: python -m
    # cosyedge_models.tools.trace_report on a step's JSON).
    # A short lease: STEPS="d x l u z e r n w m s" (no cloud without .device/cloud carried).
    voice="VOICE_WAV=/tmp/voice/en8.wav VOICE_TEXT=And+then+later+on,+fully+acquiring+that+company.+So+keeping+management+in+line,+interest+in+line+with+the+asset"
    stage="--voice+en8+--graph-threads+per-stage+--llm-parallel-prefills+4"
    goals="--voice+en8+--first-chunk+15:6+--graph-batching+--batching+16+--graph-flow-batch+--graph-encoder-batch+--llm-captured-prefill+--graph-vocoder-batch+--concurrency-mode+both"
    levels="--voice+en8+--graph-encoder-batch+--llm-captured-prefill"  # the goals' configuration in a batch step
    plan=${PLAN:-"d setup FP16=0 STATIC_FLOW_WINDOWS=64,128 FUSED_BATCHES=1,4,8,16 BATCH_FLOW_SIZES=1,8,16 BATCH_FLOW_PRECISION=fp16 BATCH_FLOW_ATTENTION=fused FUSED_PREFILL_LENGTHS=128,256,384 $voice;x batch FP16=0 JSON_TAG=goals_levels BENCH_ARGS=$levels CONCURRENCY=1,8,16;e bench FP16=0 BENCH_ARGS=$goals CONCURRENCY=1,8,16 BENCH_TIMEOUT_S=900;n bench FP16=0 JSON_TAG=batched_prefill_no_overflow_slots BENCH_ARGS=--voice+en8+--graph-batching+--batching+16+--graph-flow-batch+--llm-batched-prefill+--max-queue-delay-ms+4+--graph-flow-overflow-slots+0+--concurrency-mode+both CONCURRENCY=1,8,16 BENCH_TIMEOUT_S=900;w batch FP16=0 JSON_TAG=goals_levels_switch05 BENCH_ARGS=$levels+--python-switch-interval-ms+0.5 CONCURRENCY=1,8,16;m batch FP16=0 JSON_TAG=batched_prefill_no_overflow_slots_switch05 BENCH_ARGS=--voice+en8+--llm-batched-prefill+--max-queue-delay-ms+4+--graph-flow-overflow-slots+0+--python-switch-interval-ms+0.5 CONCURRENCY=1,8,16;a batch FP16=0 JSON_TAG=goals_levels_gather_flow150 BENCH_ARGS=$levels+--graph-flow-gather-ms+150 CONCURRENCY=1,8,16;j batch FP16=0 JSON_TAG=batched_prefill_no_overflow_slots_gather_flow150 BENCH_ARGS=--voice+en8+--llm-batched-prefill+--max-queue-delay-ms+4+--graph-flow-overflow-slots+0+--graph-flow-gather-ms+150 CONCURRENCY=1,8,16;!f bench FP16=0 COSYEDGE_ORT_SHARE_WEIGHTS=0 BENCH_ARGS=$goals CONCURRENCY=1,8,16 BENCH_TIMEOUT_S=900;l batch FP16=0 JSON_TAG=goals_levels_hop_scale2_cap50 BENCH_ARGS=$levels+--hop-scale+2+--max-hop-tokens+50 CONCURRENCY=1,8,16;u batch FP16=0 JSON_TAG=batched_prefill_no_overflow_slots_hop_scale2_cap50 BENCH_ARGS=--voice+en8+--llm-batched-prefill+--max-queue-delay-ms+4+--graph-flow-overflow-slots+0+--hop-scale+2+--max-hop-tokens+50 CONCURRENCY=1,8,16;z batch FP16=0 JSON_TAG=batched_prefill_no_overflow_slots_gather_flow150_hop_scale2_cap50 BENCH_ARGS=--voice+en8+--llm-batched-prefill+--max-queue-delay-ms+4+--graph-flow-overflow-slots+0+--graph-flow-gather-ms+150+--hop-scale+2+--max-hop-tokens+50 CONCURRENCY=1,8,16;r batch FP16=0 JSON_TAG=per_stage_p4_hop_scale2_cap50 BENCH_ARGS=$stage+--graph-encoder-batch+--hop-scale+2+--max-hop-tokens+50 CONCURRENCY=1,8,16;s batch FP16=0 JSON_TAG=goals_levels_first_15_6 BENCH_ARGS=$levels+--first-hop-tokens+15+--first-chunk-euler-steps+6 CONCURRENCY=1,8,16;c cloud FP16=0 CLOUD_TIMEOUT_S=480 CLOUD_PARAMS=GRAPH_ENCODER_BATCH=true+LLM_CAPTURED_PREFILL=true+GRAPH_VOCODER_BATCH=true;k cloud FP16=0 JSON_TAG=no_encoder_batch_no_overflow_slots CLOUD_TIMEOUT_S=480 CLOUD_PARAMS=LLM_CAPTURED_PREFILL=true+GRAPH_VOCODER_BATCH=true+GRAPH_FLOW_OVERFLOW_SLOTS=0;i cloud FP16=0 JSON_TAG=no_encoder_batch_no_overflow_slots_hop_scale2_cap50 CLOUD_TIMEOUT_S=480 CLOUD_PARAMS=LLM_CAPTURED_PREFILL=true+GRAPH_VOCODER_BATCH=true+GRAPH_FLOW_OVERFLOW_SLOTS=0+STREAM_HOP_SCALE=2+STREAM_MAX_HOP_TOKENS=50;t tests FULL=0 PYCUDA_SDIST_DIR=/nonexistent GPU_TESTS=tests/models/batching/test_fused_step.py;v batch FP16=0 JSON_TAG=goals_levels_vocoder_batch BENCH_ARGS=$levels+--graph-vocoder-batch CONCURRENCY=1,8,16;b batch FP16=0 JSON_TAG=one_thread_batched_prefill_gather BENCH_ARGS=--voice+en8+--llm-batched-prefill+--max-queue-delay-ms+4 CONCURRENCY=1,8,16;g batch FP16=0 JSON_TAG=goals_levels_gather4 BENCH_ARGS=$levels+--max-queue-delay-ms+4 CONCURRENCY=1,8,16;h batch FP16=0 JSON_TAG=goals_levels_gather4_again BENCH_ARGS=$levels+--max-queue-delay-ms+4 CONCURRENCY=1,8,16;p batch FP16=0 JSON_TAG=per_stage_p4_gather4 BENCH_ARGS=$stage+--graph-encoder-batch+--max-queue-delay-ms+4 CONCURRENCY=1,8,16;q batch FP16=0 JSON_TAG=per_stage_p4_lone_hold BENCH_ARGS=$stage+--graph-encoder-batch CONCURRENCY=1,8,16;y batch FP16=0 JSON_TAG=goals_levels_again BENCH_ARGS=$levels CONCURRENCY=1,8,16"}
    if [ -n "${STEPS:-}" ]; then
      # STEPS="d x e": only those entries of the plan, in that order (a short lease; "!f" is kept as "f")
      IFS=";" read -ra all <<<"$plan"; kept=()
      for want in $STEPS; do for e in "${all[@]}"; do read -ra w <<<"$e"; [ "${w[0]#!}" != "$want" ] || kept+=("$e"); done; done
      plan=$(IFS=";"; echo "${kept[*]}")
    fi
    echo "$plan" >"$res/plan"; : >"$res/status"  # a wait right after start finds the plan
    beside=${TESTS_BESIDE:-}
    if [ -n "$beside" ]; then
      # the -m gpu tests (tiny bundles of their own) beside the full-size setup, once device_run.sh has
      # unpacked onnxruntime into /tmp/site (the setup builds pycuda alone): the tests run during the setup
      setsid nohup bash -c 'cd "'"$repo"'"; until [ -f /tmp/site/.cosyedge-installed ]; do sleep 2; done
        FULL=0 PYCUDA_SDIST_DIR=/nonexistent GPU_TESTS="'"$beside"'" edge_build/tools/device_run.sh '"$res"'/g tests >'"$res"'/g.log 2>&1; rc=$?
        echo "$(date +%T) end g (beside) rc=$rc" >>'"$res"'/status' >/dev/null 2>&1 </dev/null &
    fi
    setsid nohup bash -c '
      cd "'"$repo"'"
      IFS=";" read -ra entries <"'"$res"'/plan"
      rc=0
      for e in "${entries[@]}"; do
        read -ra w <<<"$e"; d=${w[0]}; s=${w[1]}
        # "!dir": a fallback, run only where the entry before it failed
        if [ "${d:0:1}" = "!" ]; then d=${d:1}; [ "$rc" -ne 0 ] || { echo "$(date +%T) skip $d" >>'"$res"'/status; continue; }; fi
        vars=(); for kv in "${w[@]:2}"; do vars+=("${kv//+/ }"); done
        echo "$(date +%T) start $d $s" >>'"$res"'/status
        env "${vars[@]}" '"$runner"' '"$res"'/$d "$s" >'"$res"'/$d.log 2>&1; rc=$?
        echo "$(date +%T) end $d rc=$rc" >>'"$res"'/status
      done
      echo done >>'"$res"'/status' >/dev/null 2>&1 </dev/null &
    echo started ;;
  wait)
    if [ ! -f "$res/status" ]; then
      # a fresh machine (the last one was released between two calls): nothing to wait for, and
      # waiting would spend the lease's budget on an idle GPU
      echo "no plan on this machine (a fresh one: the plan's machine was released); start again" >&2; exit 3
    fi
    collect() {
      [ -n "${OUT:-}" ] || return 0
      # every step's JSON in one archive (the device tool brings back a bounded number of files a call: the
      # twenty-sixth run's last wait left four of twelve behind), the six newest also as files
      find "$res" -name "*.json" -newer "$res/plan" -size -15M -printf "%P\n" | tar czf "$OUT/results.tgz" -C "$res" -T -
      find "$res" -name "*.json" -newer "$res/plan" -size -15M -printf "%T@ %p\n" | sort -rn | head -6 | cut -d" " -f2- \
        | xargs -r cp -t "$OUT"
      tar czf "$OUT/logs.tgz" -C "$res" --exclude="*.wav" --exclude="*.json" . 2>/dev/null
    }
    # results are copied each time a step ends, not only at the end: a call cut short by the lease's
    # budget still brings back what had ended (the device tool returns $OUT of a timed-out call)
    end=$(( $(date +%s) + ${2:-500} )); seen=""
    while [ "$(date +%s)" -lt "$end" ] && ! grep -q '^done' "$res/status" 2>/dev/null; do
      now=$(cat "$res/status"); [ "$now" = "$seen" ] || { collect; seen=$now; }; sleep 5
    done
    cat "$res/status"; for f in "$res"/*.log; do echo "== $f"; grep -v " INFO " "$f" | tail -8; done
    collect ;;
esac
