"""The one `cosyedge` command line. It only parses and dispatches: every
subcommand lives in its own module, imported when it is chosen, so that
`cosyedge run` on a board never imports torch, the build side or the cloud
side."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence

from cosyedge_models.synthesis.modes import GRAPH_THREAD_MODES, LLM_FIRST_CHUNK_PRIORITIES, MODES

# subcommand -> "module:function"; the function takes the parsed arguments
# and returns the process exit status.
_HANDLERS: dict[str, str] = {
    "run": "cosyedge_daemon.cli.run:run_command",
    "say": "cosyedge_daemon.cli.say:say_command",
    "synth": "cosyedge_daemon.cli.synth:synth_command",
    "build": "cosyedge_daemon.cli.build:build_command",
    "vad": "cosyedge_daemon.cli.vad:vad_command",
    "bench": "cosyedge_daemon.cli.bench:bench_command",
    "bridge": "cosyedge_cloud.bridge.main:bridge_command",
    "triton": "cosyedge_cloud.triton.launcher:triton_command",
    "doctor": "cosyedge_daemon.cli.doctor:doctor_command",
    "voice": "cosyedge_daemon.cli.voice:voice_command",
    "model": "cosyedge_daemon.cli.model:model_command",
}


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run the daemon in the foreground (systemd runs this)")
    p.add_argument("--config", help="TOML config file (optional; flags override it)")
    p.add_argument("--broker", help="MQTT broker URL, e.g. mqtt://localhost:1883 or mqtts://host:8883")
    p.add_argument("--device-id", help="device id; the topic prefix is cosyedge/<device-id>")
    p.add_argument("--bundle", help="model bundle directory (default: the tiny bundle, built on first use)")
    p.add_argument("--audio", help="audio device: none, default or a device name")
    p.add_argument("--wyoming-uri", help="serve Wyoming TTS (Home Assistant) on tcp://HOST:PORT (port 10200)")
    p.add_argument("--http-listen", metavar="HOST:PORT",
                   help="serve the OpenAI-style speech API (POST /v1/audio/speech) on HOST:PORT, e.g. 127.0.0.1:8880")


def _add_say(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("say", help="send one request to a running daemon over MQTT")
    p.add_argument("text")
    p.add_argument("--broker", help="MQTT broker URL (default mqtt://localhost:1883)")
    p.add_argument("--device-id", help="device id of the daemon")
    p.add_argument("--out", help="write the audio to this WAV file instead of playing it")
    p.add_argument("--voice")
    p.add_argument("--route", choices=["auto", "local", "cloud"], default="auto")
    p.add_argument("--mode", choices=MODES)
    p.add_argument("--instruct-text")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--wyoming", metavar="tcp://HOST:PORT", help="ask a Wyoming TTS server instead of MQTT")
    p.add_argument("--wyoming-stream", action="store_true", help="with --wyoming: streaming synthesis")


def _add_synth(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("synth", help="offline synthesis: no daemon, no broker")
    p.add_argument("text")
    p.add_argument("--bundle", required=True)
    p.add_argument("--out", required=True, help="output WAV file")
    p.add_argument("--stream", action="store_true", help="synthesize in streaming chunks")
    p.add_argument("--voice")
    p.add_argument("--mode", choices=MODES, default=None)
    p.add_argument("--instruct-text")
    p.add_argument("--prompt-wav", help="voice reference audio for zero_shot / cross_lingual")
    p.add_argument("--prompt-text", help="transcript of --prompt-wav (zero_shot)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="ort", help="inference backend: ort or trt")


def _add_build(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build", help="build side: tiny checkpoint, export, quantize, engines, validate")
    bs = p.add_subparsers(dest="build_cmd", required=True)
    t = bs.add_parser("tiny", help="write a randomly initialised CosyVoice 2 checkpoint (official layout)")
    t.add_argument("--out", required=True)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--size", choices=["tiny", "full"], default="tiny")
    e = bs.add_parser("export", help="export a CosyVoice 2 checkpoint to an ONNX bundle")
    e.add_argument("--model-dir", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--static-decode-len", type=int, default=0, metavar="POSITIONS",
                   help="also export a fixed-size LLM decode step for this many positions (prompt + speech "
                        "tokens): ort-cuda replays it as a CUDA graph; weights shared with the LLM (0: off)")
    e.add_argument("--static-flow-windows", default="", metavar="FRAMES,...",
                   help="also export fixed-shape flow estimator ONNX graphs for these streaming window sizes (mel "
                        "frames; shorter windows are padded), and the streaming flow encoder's for the same "
                        "windows: ort-cuda replays them as CUDA graphs")
    e.add_argument("--static-flow-cache", type=int, default=1024, metavar="FRAMES",
                   help="committed frames the fixed-shape estimator ONNX graphs hold (longer streams use the dynamic "
                        "ONNX graph)")
    e.add_argument("--static-vocoder", action="store_true",
                   help="also export fixed-length vocoder ONNX graphs for the first and the steady streaming chunk: "
                        "ort-cuda replays them as CUDA graphs (other lengths use the dynamic ONNX graphs)")
    e.add_argument("--static-vocoder-first-hops", default="", metavar="TOKENS,...",
                   help="with --static-vocoder: also a fixed-length vocoder graph for the first chunk of these "
                        "first hops in speech tokens ([tts] first_hop_tokens), e.g. 15")
    e.add_argument("--static-vocoder-hops", default="", metavar="TOKENS,...",
                   help="with --static-vocoder: also the fixed-length vocoder graphs of these later hops in speech "
                        "tokens (the steady chunk, and an offline request's first chunk), the ones a growing hop "
                        "reaches ([tts] stream_hop_scale 2 with stream_max_hop_tokens 50: 50)")
    e.add_argument("--fused-decode-batches", default="", metavar="B,...",
                   help="also export the onnxruntime-fused batched LLM decode step (GroupQueryAttention over an "
                        "in-place KV cache) for these batch sizes, e.g. 1,2,4,8,16 (TensorRT keeps the plain graphs)")
    e.add_argument("--fused-prefill-lengths", default="", metavar="T,...",
                   help="with --fused-decode-batches: also one row's prefill graph of each of these prompt lengths "
                        "in positions, e.g. 64,128,256 (captured on ort-cuda: [tts] llm_captured_prefill)")
    e.add_argument("--fused-decode-len", type=int, default=0, metavar="POSITIONS",
                   help="cache positions of the fused decode step (0: --static-decode-len, else 1536)")
    e.add_argument("--batch-flow-sizes", default="", metavar="B,...",
                   help="with --static-flow-windows: also export the estimator windows batched across B streams "
                        "(K/V cache written in place), for these batch sizes, e.g. 1,2,4,8")
    e.add_argument("--batch-flow-precision", choices=["fp32", "fp16"], default="fp32",
                   help="precision of the batched estimator windows and their K/V lanes: fp16 halves the lanes' "
                        "device memory (the time embedding stays fp32)")
    e.add_argument("--batch-flow-attention", choices=["plain", "fused"], default="plain",
                   help="attention of the batched estimator windows: fused writes onnxruntime's MultiHeadAttention "
                        "(fewer kernels a replay; onnxruntime only), plain standard operators")
    e.add_argument("--fused-decode-precision", choices=["fp32", "fp16"], default="fp32",
                   help="precision of the fused decode step and its KV cache: fp16 for ort-cuda, whose "
                        "GroupQueryAttention kernel is fp16/bf16 only (fp32 would run attention on the CPU provider)")
    e.add_argument("--jobs", type=int, choices=[1, 2], default=1,
                   help="2: export the flow and the vocoder in a second process beside the LLM (about half the "
                        "time on a many-core host; a second copy of the checkpoint in memory, so not on an 8 GB board)")
    q = bs.add_parser("quantize", help="INT8 / FP16 Q/DQ bundle with an accuracy gate")
    q.add_argument("--bundle", required=True)
    q.add_argument("--out", required=True)
    q.add_argument("--precision", choices=["int8", "int8w", "fp16"], default="int8",
                   help="int8: Q/DQ for TensorRT; int8w: weight-only for onnxruntime; fp16")
    q.add_argument("--calibration-size", type=int, default=None, help="calibration texts (default 8)")
    q.add_argument("--held-out-size", type=int, default=None, help="held-out texts for the report (default 3)")
    q.add_argument("--feeds-per-stage", type=int, default=None, help="recorded inputs per stage (default 32)")
    q.add_argument("--calibration-method", choices=["minmax", "percentile"], default=None)
    q.add_argument("--min-llm-cosine", type=float, default=None, help="budget: LLM logits cosine (default 0.99)")
    q.add_argument("--min-llm-top1", type=float, default=None, help="budget: LLM top-1 agreement (default 0.90)")
    q.add_argument("--min-mel-snr-db", type=float, default=None, help="budget: flow mel SNR (default 15)")
    q.add_argument("--min-wav-snr-db", type=float, default=None, help="budget: vocoder SNR (default 10)")
    q.add_argument("--min-e2e-match", type=float, default=None,
                   help="budget: share of speech tokens equal to fp32 under seeded sampling (default 0.5)")
    q.add_argument("--force", action="store_true", help="write the bundle even if it misses the budget")
    q.add_argument("--max-memory-gb", type=float, default=None,
                   help="refuse to start when the estimated peak memory exceeds this (free memory is always checked)")
    g = bs.add_parser("engines", help="build TensorRT engines for a bundle (on the board)")
    g.add_argument("--bundle", required=True)
    g.add_argument("--precision", choices=["fp32", "fp16", "int8"],
                   help="which stage variant to build from (default: the bundle's own)")
    g.add_argument("--board", choices=["agx-orin-32gb", "agx-orin-64gb", "orin-nano-8gb", "orin-nx-16gb"],
                   help="Jetson module to size the workspace and the memory check for "
                        "(default: guessed on a Jetson)")
    g.add_argument("--workspace-mib", type=int, help="TensorRT builder workspace limit (default: per board)")
    g.add_argument("--max-batch", type=int, help="cap the batch dimension of every profile")
    g.add_argument("--stages", help="comma-separated subset of the bundle's stages")
    g.add_argument("--device", type=int, default=0, help="CUDA device index")
    g.add_argument("--json", dest="json_out", help="also write the engines metadata to this file")
    v = bs.add_parser("validate", help="check a bundle against its source checkpoint")
    v.add_argument("--bundle", required=True)
    v.add_argument("--model-dir", help="source checkpoint (default: the path in the manifest)")


def _add_vad(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("vad", help="run the daemon's VAD segmentation on a recording")
    p.add_argument("wav")
    p.add_argument("--aggressiveness", type=int, choices=[0, 1, 2, 3])
    p.add_argument("--frame-ms", type=int, choices=[10, 20, 30])
    p.add_argument("--config", help="TOML config file whose [vad] section to use")


def _switch_interval_ms(text: str) -> float:
    from cosyedge_daemon.settings.tts import SWITCH_INTERVAL_MS  # the setting's range (numpy: only when given)

    low, high = SWITCH_INTERVAL_MS
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of milliseconds") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{value:g} ms is outside {low:g} .. {high:g} ms")
    return value


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="engine and end-to-end benchmarks")
    p.add_argument("--bundle", required=True)
    p.add_argument("--reference", action="store_true",
                   help="also run the official PyTorch pipeline on the same checkpoint")
    p.add_argument("--concurrency", default="1", help="comma-separated request concurrency, e.g. 1,2,4 (level n "
                   "serves n requests at once; level 1 the largest level's requests one after another)")
    p.add_argument("--json", help="write the results to this JSON file")
    p.add_argument("--backend", default="ort")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--text", help="benchmark text (default: a built-in sentence)")
    p.add_argument("--voice", metavar="NAME",
                   help="measure everything with this saved zero-shot voice (and its cache off vs on: voice_cache)")
    p.add_argument("--voice-wav", metavar="WAV",
                   help="with --voice: the voice's recording, also sent inline with each request (not cacheable)")
    p.add_argument("--voice-cache-mb", type=int, default=None,
                   help="the per-voice prompt cache budget in MiB (default: the engine's; 0: off)")
    p.add_argument("--batching", type=int, default=0, metavar="MAX_BATCH_SIZE",
                   help="batch the LLM across concurrent requests, up to this many (0: off, each decodes alone)")
    p.add_argument("--max-queue-delay-ms", type=float, default=0.0,
                   help="with --batching: how long a request may wait to join so that the batch fills up")
    p.add_argument("--graph-batching", action="store_true",
                   help="with --batching and the fixed-size decode: the LLM batch through the iteration-level "
                        "scheduler over the fixed-shape step (its slots: --batching, at least 4)")
    p.add_argument("--graph-flow-batch", action="store_true",
                   help="with the fixed-shape flow windows (--graph-flow) and a bundle exported with "
                        "--batch-flow-sizes: concurrent streams' estimator windows as one batched replay")
    p.add_argument("--graph-flow-overflow-slots", type=int, default=None, metavar="STREAMS",
                   help="with --graph-flow-batch: single-stream fixed-shape slots beside the batched lanes for the "
                        "streams beyond them (default: the engine's; 0: every stream on a lane, and their memory to "
                        "the lanes)")
    p.add_argument("--graph-flow-gather-ms", type=float, default=0.0, metavar="MS",
                   help="with --graph-flow-batch: a later chunk's flow waits up to MS, out of the audio its stream "
                        "has queued ahead of playback, for other streams' chunks, so that they share the estimator "
                        "replays (default 0: off)")
    p.add_argument("--graph-encoder-batch", action="store_true",
                   help="with --graph-flow-batch and a bundle whose export has the batched encoder graphs: "
                        "concurrent streams' flow encoder calls waiting together as one batched replay")
    p.add_argument("--graph-vocoder-batch", action="store_true",
                   help="with the fixed-length vocoder graphs and a bundle whose export has their batched graphs: "
                        "concurrent streams' vocoder chunks of one length waiting together as one batched replay")
    p.add_argument("--llm-prefills-between-steps", type=int, default=8,
                   help="with --graph-batching: the most new requests' prefills a running stream waits for")
    p.add_argument("--llm-parallel-prefills", type=int, default=4, metavar="THREADS",
                   help="with --graph-batching: a round's new requests' prefills run on up to this many threads "
                        "at once (1: one after another)")
    p.add_argument("--llm-batched-prefill", action="store_true",
                   help="with --graph-batching on a fused step: a round's new prompts in one prefill run")
    p.add_argument("--llm-captured-prefill", action="store_true",
                   help="with --graph-batching on a fused step: new prompts through the bundle's fixed-length "
                        "prefill graphs (captured on ort-cuda)")
    p.add_argument("--llm-first-chunk-priority", choices=LLM_FIRST_CHUNK_PRIORITIES, default="normal",
                   help="with --graph-batching: a step sampling a stream's first-chunk tokens runs behind the first "
                        "chunks' flows (normal) or in turn with them (first_audio)")
    p.add_argument("--flow-batching", type=int, default=0, metavar="MAX_BATCH_SIZE",
                   help="batch the flow estimator and vocoder calls of up to this many concurrent requests "
                        "(0: off, each runs alone)")
    p.add_argument("--flow-queue-delay-ms", type=float, default=0.0,
                   help="with --flow-batching: how long a flow or vocoder call may wait for others")
    p.add_argument("--vocoder-pad-final", action=argparse.BooleanOptionalAction, default=None,
                   help="a stream's last chunk right-padded into a fixed-length vocoder graph (default: on for "
                        "ort-cuda)")
    p.add_argument("--offline-as-stream", action=argparse.BooleanOptionalAction, default=None,
                   help="offline requests as streams whose chunks are joined, so the streams' batched replays serve "
                        "them (default: on where --graph-flow-batch's lanes load)")
    p.add_argument("--concurrency-mode", choices=("stream", "offline", "both"), default="stream",
                   help="whether the --concurrency requests stream (default), run offline, or both")
    p.add_argument("--graph-trace-ms", type=float, default=1000.0, metavar="MS",
                   help="each --concurrency level (streamed and offline) records what the GPU graph threads ran in its "
                        "first MS (graph_trace in the JSON, drawn on stderr; 0: off)")
    p.add_argument("--python-switch-interval-ms", type=_switch_interval_ms, default=None, metavar="MS",
                   help="Python's thread switch interval for the bench's process ([tts] python_switch_interval_ms; "
                        "default: Python's 5 ms)")
    p.add_argument("--concurrency-only", action="store_true",
                   help="after a warm-up, measure only the --concurrency runs")
    p.add_argument("--llm-only", action="store_true",
                   help="measure only the LLM (speech tokens/s at each --concurrency), no flow or vocoder")
    p.add_argument("--graph-flow", action=argparse.BooleanOptionalAction, default=None,
                   help="replay the bundle's fixed-shape flow estimator and encoder ONNX graphs as CUDA graphs (build "
                        "export --static-flow-windows; every slot captured at load on the CUDA graph thread); "
                        "default auto: on for ort-cuda with the slots that fit a quarter of the GPU's memory")
    p.add_argument("--graph-encoder", action=argparse.BooleanOptionalAction, default=None,
                   help="the streaming flow encoder's fixed-shape ONNX graphs as CUDA graphs too (default auto: with "
                        "--graph-flow's); "
                        "--no-graph-encoder keeps the encoder on its dynamic ONNX graph on each request's thread")
    p.add_argument("--graph-threads", choices=GRAPH_THREAD_MODES, default=GRAPH_THREAD_MODES[0],
                   help="the captured stages (LLM step, flow windows, vocoder) replay on one CUDA graph thread "
                        "(default) or on a thread each, so that streams overlap on the GPU")
    p.add_argument("--first-audio-first", action=argparse.BooleanOptionalAction, default=True,
                   help="a stream's first chunk (flow and vocoder) runs ahead of the captured LLM steps on the CUDA "
                        "graph thread, which wait meanwhile (default); --no-first-audio-first: submission order "
                        "(the report's graph_order says what the order did)")
    p.add_argument("--first-hop-tokens", type=int, default=None, metavar="TOKENS",
                   help="every measured stream's first hop in speech tokens ([tts] first_hop_tokens; default: "
                        "upstream's aligned hop)")
    p.add_argument("--first-chunk-euler-steps", type=int, default=None, metavar="STEPS",
                   help="every measured stream's Euler steps on its first chunk ([tts] first_chunk_euler_steps; "
                        "default: the bundle's)")
    p.add_argument("--first-hop", metavar="N[,M..]",
                   help="also measure time to first audio for these first hops (speech tokens)")
    p.add_argument("--first-chunk", metavar="HOP:STEPS[,..]",
                   help="also measure first audio and the mel against the default for these first hops (speech "
                        "tokens) with these Euler steps on the first chunk (0: the default of either), e.g. 15:6,25:6")
    p.add_argument("--project", action="store_true",
                   help="print the Jetson projection (per-stage time, first audio and RTF per board and precision, "
                        "from the ONNX graphs' FLOPs and bytes and the boards' published peaks) and exit")
    p.add_argument("--project-prompt-tokens", type=int, default=None,
                   help="with --project: LLM prompt length to price (default 30: sos + text + task)")
    p.add_argument("--compare", "--bundles", dest="compare", metavar="B1,B2,..",
                   help="also measure these bundles (e.g. fp32/fp16/int8 from build quantize) on the same backend")
    p.add_argument("--long-seconds", type=float, default=20.0,
                   help="length of the utterance for streaming vs offline cost (default: 20 s)")
    p.add_argument("--serial", action="store_true",
                   help="run the streaming stages one after another (no LLM / flow+vocoder overlap)")
    p.add_argument("--hop-scale", type=float, default=1.0,
                   help="grow the streaming hop by this factor after each chunk, up to 4x "
                        "(upstream: stream_scale_factor)")
    p.add_argument("--max-hop-tokens", type=int, default=None, metavar="TOKENS",
                   help="the growing hop's cap ([tts] stream_max_hop_tokens; default: 4x the hop)")
    p.add_argument("--overlap", action="store_true", default=None,
                   help="overlap the streaming stages even on a CPU of fewer than 4 cores (default: auto)")
    p.add_argument("--flow-final-chunk", choices=("cached", "upstream"), default="cached",
                   help="streaming's last flow chunk: through the estimator caches (linear cost, default) "
                        "or upstream's full-length pass (exact)")


def _add_bridge(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bridge", help="the cloud bridge service (MQTT <-> Triton)")
    p.add_argument("--config")
    p.add_argument("--broker")
    p.add_argument("--triton", help="Triton gRPC URL, e.g. localhost:8001")


def _add_triton(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("triton", help="a local Triton server on the repository in cloud_bridge/")
    p.add_argument("--bundle", required=True)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--version-bundle", action="append", default=[], metavar="V=DIR",
                   help="serve model version V from bundle DIR (repeatable; default: every version from --bundle)")
    p.add_argument("--address", default="127.0.0.1", help="address the server listens on")
    p.add_argument("--workdir", help="where the prepared model repository is written (default: a temp dir)")
    p.add_argument("--max-batch-size", type=int, help="Triton's max_batch_size (and the engine's LLM batch rows)")
    p.add_argument("--queue-delay-us", type=int, help="Triton's max_queue_delay_microseconds")
    p.add_argument("--gpu", action="store_true", help="the model instance on the GPU (KIND_GPU)")


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check GPU, TensorRT, engines, audio devices and broker")
    p.add_argument("--config")
    p.add_argument("--bundle")
    p.add_argument("--broker")


def _add_voice(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("voice", help="manage the voices of a bundle")
    vs = p.add_subparsers(dest="voice_cmd", required=True)
    a = vs.add_parser("add", help="add a voice from a reference recording")
    a.add_argument("name")
    a.add_argument("--bundle", required=True)
    a.add_argument("--wav", required=True)
    a.add_argument("--text", required=True, help="transcript of the recording")
    ls = vs.add_parser("list", help="list the voices of a bundle")
    ls.add_argument("--bundle", required=True)


def _add_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="download and build bundles, list and remove them (the bundles folder)")
    ms = p.add_subparsers(dest="model_cmd", required=True)
    for name, help_text in (("list", "list the installed bundles"), ("remove", "delete an installed bundle")):
        m = ms.add_parser(name, help=help_text)
        m.add_argument("--config", help="TOML config file whose [tts] bundles_dir to use")
        m.add_argument("--bundles-dir", help="the bundles folder (default: [tts] bundles_dir, see docs/models.md)")
        if name == "remove":
            m.add_argument("name", help="the bundle's name, as `cosyedge model list` shows it")
            m.add_argument("--force", action="store_true", help="also when it is the configured [tts] bundle")
    pull = ms.add_parser("pull", help="download a CosyVoice 2 checkpoint and build the bundle for this machine")
    pull.add_argument("name", nargs="?", default="CosyVoice2-0.5B",
                      help="CosyVoice2-0.5B (default) or a repository id owner/name in the same layout")
    pull.add_argument("--source", choices=["huggingface", "modelscope"], default="huggingface")
    pull.add_argument("--revision", help="branch, tag or commit to pin (default: main; ModelScope: master)")
    pull.add_argument("--precision", choices=["auto", "fp32", "fp16", "int8", "int8w"], default="auto",
                      help="auto: int8 with TensorRT, fp16 on a CUDA GPU, fp32 on a CPU")
    pull.add_argument("--engines", action=argparse.BooleanOptionalAction, default=None,
                      help="build TensorRT engines into the bundle (default: when TensorRT is available)")
    pull.add_argument("--endpoint", help="hub URL (default: $HF_ENDPOINT or https://huggingface.co; ModelScope: "
                                         "https://$MODELSCOPE_DOMAIN or https://www.modelscope.cn)")
    pull.add_argument("--config", help="TOML config file: its [tts] bundles_dir; --set-default writes it")
    pull.add_argument("--bundles-dir", help="install here (default: [tts] bundles_dir, see docs/models.md)")
    pull.add_argument("--set-default", action="store_true",
                      help="write [tts] bundle and backend into the --config file")
    pull.add_argument("--keep-work", action="store_true",
                      help="keep the downloaded checkpoint and the fp32 export (for another precision later)")
    pull.add_argument("--skip-resource-check", action="store_true",
                      help="start even when the disk or memory estimate does not fit")


_ADDERS: Sequence[Callable[[argparse._SubParsersAction], None]] = (
    _add_run, _add_say, _add_synth, _add_build, _add_vad, _add_bench,
    _add_bridge, _add_triton, _add_doctor, _add_voice, _add_model,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cosyedge", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _ADDERS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2) if args.command not in ("run", "bridge", "model") else (
        logging.DEBUG if args.verbose >= 2 else logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    module_name, func_name = _HANDLERS[args.command].split(":")
    try:
        handler = getattr(importlib.import_module(module_name), func_name)
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a clean message for expected errors, not a traceback
        from cosyedge_models.errors import CosyEdgeError

        if isinstance(exc, CosyEdgeError):
            print(f"cosyedge {args.command}: {exc}", file=sys.stderr)
            return 2
        raise
