"""The daemon's [tts] section: the synthesizer, its engine and its GPU batching (schema.py gathers
every section into Settings)."""

from __future__ import annotations

from dataclasses import dataclass

from cosyedge_models.settings_schema import setting
from cosyedge_models.synthesis.api import MAX_TEXT_CHARS
from cosyedge_models.synthesis.flow_gather import GATHER_MARGIN_S, MAX_GATHER_MS
from cosyedge_models.synthesis.modes import GRAPH_THREAD_MODES, LLM_FIRST_CHUNK_PRIORITIES, MAX_PARALLEL_PREFILLS

AUTO_WORKERS_MAX = 4  # synthesis_workers = "auto": beyond this the flow/vocoder, not the LLM, bound a board
MAX_WORKERS = 64  # synthesis_workers' largest value
SWITCH_INTERVAL_MS = (0.05, 100.0)  # python_switch_interval_ms' range (bench --python-switch-interval-ms too)


@dataclass(frozen=True)
class TtsSettings:
    engine: str = setting(
        "cosyvoice",
        "the local synthesizer: a CosyVoice bundle, or espeak-ng only",
        choices=("cosyvoice", "espeak-ng"), reload=True,
    )
    bundle: str = setting(
        "",
        "model bundle directory; empty: the tiny bundle in the cache directory, "
        "built on first use (needs the build extra)", reload=True,
    )
    bundles_dir: str = setting(
        "",
        "where `cosyedge model pull` installs bundles and `model list` / `doctor` look; empty: "
        "$STATE_DIRECTORY/bundles under systemd, else /var/lib/cosyedge/bundles when this user may write it, "
        "else $XDG_DATA_HOME/cosyedge/bundles (~/.local/share)",
    )
    backend: str = setting(
        "ort", "inference backend of the bundle", choices=("ort", "ort-cuda", "ort-trt", "trt"), reload=True
    )
    default_voice: str = setting(
        "", "voice when a request names none; empty: the bundle's default. A saved voice with a recording is "
        "prepared when the engine loads (its prompt caches; on a GPU with graph_flow_batch its flow prefix in "
        "every batched lane), so its first requests start sooner", live=True
    )
    default_output: str = setting(
        "auto",
        "output when a request names none; auto: play if an audio device is configured, else publish",
        choices=("auto", "play", "publish", "both"),
        live=True,
    )
    max_text_chars: int = setting(
        MAX_TEXT_CHARS, "longer text is rejected with text_too_long (by every front end, and by the local "
        "synthesizer, which SIGHUP reloads with it)", min=1, max=1_000_000, live=True, reload=True
    )
    max_prompt_s: float = setting(30.0, "longest voice-reference (prompt) audio", min=1, max=600, live=True)
    llm_max_batch_size: int = setting(
        0, "decode the LLM of up to this many concurrent requests as one batch (0: off, each decodes alone)",
        min=0, max=256, reload=True,
    )
    llm_max_queue_delay_ms: float = setting(
        0.0, "with llm_max_batch_size: how long a request may wait to join so that the batch fills up",
        min=0, max=10_000, reload=True,
    )
    graph_batching: bool = setting(
        False, "with llm_max_batch_size and the fixed-size decode on (ort-cuda, bundles exported with "
        "--static-decode-len): the LLM batch runs through the iteration-level scheduler over the fixed-shape "
        "step, one step per token for every running stream on the GPU graph thread (at most the "
        "fixed-size decode's 4 slots); off: the dynamic-graph batcher",
        reload=True,
    )
    graph_threads: str = setting(
        "one", "how the captured GPU stages (LLM step, flow windows, vocoder) replay: one: on one GPU graph "
        "thread, one replay at a time (a stream's first chunk goes first and LLM steps wait meanwhile); "
        "per-stage: on a thread each, so the LLM steps run beside the flow replays (a first chunk then holds "
        "the flow and vocoder threads only)",
        choices=GRAPH_THREAD_MODES, reload=True,
    )
    graph_flow_batch: bool = setting(
        False, "with the fixed-shape flow windows on (ort-cuda, bundles exported with --static-flow-windows and "
        "--batch-flow-sizes): concurrent streams' estimator windows of the same size at the same Euler step run "
        "as one batched replay on the GPU graph thread (as many streams as the largest batch size whose lanes "
        "fit the GPU's memory beside the stages loaded after them; more run alone as before); off: one "
        "replay per stream's window",
        reload=True,
    )
    graph_flow_gather_ms: float = setting(
        0.0, "with graph_flow_batch: a stream's later chunk waits up to this long, and only out of the audio it has "
        f"queued ahead of playback (less {GATHER_MARGIN_S} s), for other streams' chunks, so that their estimator "
        "steps share batched replays; 0: off",
        min=0, max=MAX_GATHER_MS, reload=True,
    )
    graph_encoder_batch: bool = setting(
        False, "with graph_flow_batch and a bundle exported by this version with --batch-flow-sizes: concurrent "
        "streams' flow encoder calls that wait together (a level's first chunks) run as one batched replay on the "
        "GPU graph thread; off: one replay per stream's call",
        reload=True,
    )
    graph_vocoder_batch: bool = setting(
        False, "with the fixed-length vocoder graphs and a bundle exported by this version with --static-vocoder "
        "and --batch-flow-sizes: concurrent streams' vocoder chunks of one length that wait together run as one "
        "batched replay on the GPU graph thread; off: one replay per stream's chunk",
        reload=True,
    )
    vocoder_pad_final: str = setting(
        "auto", "with the fixed-length vocoder graphs (bundles exported with --static-vocoder): a stream's last chunk "
        "right-padded into the shortest graph that holds it, its audio cut back, instead of the dynamic vocoder at its "
        "exact length (on CUDA a new length costs 150-200 ms a graph to set up); its last ~0.2 s then differ a little "
        "from the exact length's; auto: on for ort-cuda",
        choices=("auto", "on", "off"), reload=True,
    )
    offline_as_stream: str = setting(
        "auto", "offline (stream=false) requests synthesized as streams whose chunks are joined, so that the "
        "streams' batched GPU work serves them too (their audio is then a streamed request's: chunk-causal "
        "flow; speed other than 1.0 stays offline); auto: on where graph_flow_batch's lanes are loaded",
        choices=("auto", "on", "off"), reload=True,
    )
    llm_prefills_between_steps: int = setting(
        8, "with graph_batching: a running stream waits for at most this many new requests' prefills between "
        "two of its decode steps (more: new requests start sooner and in step, so their flow shares batched "
        "replays; running ones stall longer)",
        min=1, max=64, reload=True,
    )
    llm_first_chunk_priority: str = setting(
        "normal", "with graph_batching: how a batched LLM step that samples some stream's first-chunk tokens "
        "runs on the GPU graph thread; normal: behind every first chunk's flow waiting (the streams that got "
        "their tokens first speak first); first_audio: in turn with those flows (later streams' first chunks "
        "are not held behind earlier streams' flows)",
        choices=LLM_FIRST_CHUNK_PRIORITIES, reload=True,
    )
    llm_parallel_prefills: int = setting(
        4, "with graph_batching: a round's new requests' prefills (each a run of the dynamic LLM graph, bound "
        "by kernel launches on a GPU) run on up to this many threads at once; 1: one after another",
        min=1, max=MAX_PARALLEL_PREFILLS, reload=True,
    )
    llm_batched_prefill: bool = setting(
        False, "with graph_batching on a bundle's fused LLM step: a round's new requests' prompts (of one voice "
        "prefix length) in one run of the prefill graph instead of one run each; off: llm_parallel_prefills",
        reload=True,
    )
    llm_captured_prefill: bool = setting(
        False, "with graph_batching on a bundle's fused LLM step with fixed-length prefill graphs (build export "
        "--fused-prefill-lengths): each new prompt through the shortest that fits it, captured on ort-cuda, "
        "instead of a run of the dynamic prefill graph; prompts longer than all take the dynamic graph",
        reload=True,
    )
    python_switch_interval_ms: float = setting(
        5.0, "Python's thread switch interval (sys.setswitchinterval, for the whole daemon): how long a busy "
        "thread keeps the interpreter lock while another waits for it. Lower: the GPU graph thread gets it back "
        "sooner among the request threads (on an H100 a graph-thread turn of a little Python took 84 ms among "
        "sixteen streams' threads); 5: Python's own", min=SWITCH_INTERVAL_MS[0], max=SWITCH_INTERVAL_MS[1],
        live=True,
    )
    synthesis_workers: int | str = setting(
        "auto", "requests synthesized at once (each on its own worker thread, so the LLM batcher can batch "
        "them; played requests still play one at a time, in order); auto: 1 without llm_max_batch_size, "
        f"llm_max_batch_size with graph_flow_batch (the flow batched too; the engine's stream seats bound the "
        f"local requests at once, the rest wait in the queue), else min(llm_max_batch_size, {AUTO_WORKERS_MAX})",
        choices=("auto",), min=1, max=MAX_WORKERS,
    )
    flow_max_batch_size: int = setting(
        0, "run the flow estimator and vocoder calls of up to this many concurrent requests as one batch "
        "(0: off, each runs alone); on ort-cuda it turns the fixed-shape CUDA graphs off, which measured far "
        "slower on an H200",
        min=0, max=256, reload=True,
    )
    flow_max_queue_delay_ms: float = setting(
        0.0, "with flow_max_batch_size: how long a flow or vocoder call may wait for the requests whose "
        "previous call just returned (a lone request never waits); 0: only calls already queued merge",
        min=0, max=10_000, reload=True,
    )
    overlap_stages: str = setting(
        "auto", "streaming: the LLM decodes the next chunk on its own thread while flow and vocoder work on this "
        "one; auto: on with a GPU backend or 4+ CPU cores",
        choices=("auto", "on", "off"), reload=True,
    )
    first_hop_tokens: int = setting(
        0, "speech tokens before the first audio chunk (smaller: sooner first audio); 0: upstream's aligned hop; "
        "a bundle exported with --static-vocoder-first-hops N replays that first chunk's vocoder as a fixed-length "
        "graph (else the dynamic vocoder, set up at that length at load); at least 5 with CosyVoice 2 (a shorter "
        "first chunk's audio would not cover the vocoder's cross-fade: the engine refuses it at load)",
        min=0, max=200, reload=True,
    )
    first_chunk_euler_steps: int = setting(
        0, "Euler steps of the flow for the first audio chunk only (fewer: sooner first audio, a coarser first "
        "chunk; later chunks unchanged; docs/engine.md has the trade-off); 0: the model's own (10 for CosyVoice 2)",
        min=0, max=100, reload=True,
    )
    stream_hop_scale: float = setting(
        1.0, "grow the streaming hop by this factor after each chunk, up to 4x (upstream's stream_scale_factor; "
        "2: chunks of 25, 50, then 100 tokens, less total work, same first audio; stream_max_hop_tokens caps it); "
        "1: a fixed hop",
        min=1.0, max=4.0, reload=True,
    )
    stream_max_hop_tokens: int = setting(
        0, "the growing hop's cap in speech tokens (stream_hop_scale above 1); 0: 4x the hop (upstream). On the "
        "GPU a cap whose chunks fit the bundle's largest fixed-shape estimator window keeps them on the captured "
        "graphs (the engine's log says which cap fits: 50 with windows of 128 frames; a multiple of the hop keeps "
        "each chunk on the flow's attention chunks, as upstream); a bundle exported with "
        "--static-vocoder-hops N replays those chunks' vocoder as fixed-length graphs; at least the bundle's hop",
        min=0, max=1000, reload=True,
    )
    flow_final_chunk: str = setting(
        "cached", "streaming's last flow chunk: through the per-request caches (linear cost) or upstream's "
        "full-length pass (exactly upstream's audio, about twice the flow cost)",
        choices=("cached", "upstream"), reload=True,
    )
    flow_left_chunks: int = setting(
        -1, "streaming flow context in 1 s chunks; -1: all (exact); N: the last N only, bounding the cache "
        "memory (about 219 MiB per second of audio at full size) but changing the audio",
        min=-1, max=100_000, reload=True,
    )
    cpu_memory_arena: bool = setting(
        False, "onnxruntime's CPU memory arena: on keeps every run's peak host memory allocated for the "
        "process's life (about 2% faster on a CPU); off frees it as it goes (less memory after long requests)",
        reload=True,
    )
    voice_cache_mb: int = setting(
        2048, "per-voice prompt caches for saved voices (streaming flow state of the prompt and, for zero_shot, "
        "the LLM's KV cache of sos + transcript, computed once per voice and reused; about 4.4 MiB per prompt mel "
        "frame at full size in fp32, ~1.5 GiB for an 8 s prompt), in MiB of host memory; 0: off (same audio, "
        "slower first chunk)",
        min=0, max=1_000_000, reload=True,
    )

    @property
    def synthesis_worker_count(self) -> int:
        """`synthesis_workers` with auto resolved: concurrency pays only where the LLM batches."""
        if isinstance(self.synthesis_workers, int):
            return self.synthesis_workers
        if self.engine != "cosyvoice" or not self.llm_max_batch_size:
            return 1
        if self.graph_flow_batch:  # the GPU lanes batch the flow too: their seats bound it (Scheduler.local_limit)
            return min(self.llm_max_batch_size, MAX_WORKERS)
        return min(self.llm_max_batch_size, AUTO_WORKERS_MAX)
