"""What a CosyVoice synthesizer is configured with: backend, precision,
streaming, overlap, batching, caches and CUDA graphs. One frozen object,
checked when it is built (models/synthesis/synthesizer.py runs with it)."""

from __future__ import annotations

from dataclasses import dataclass

from cosyedge_models.backends.fixed_shapes import OVERFLOW_FLOW_SLOTS
from cosyedge_models.batching.policy import BatchSettings
from cosyedge_models.synthesis.api import MAX_TEXT_CHARS
from cosyedge_models.synthesis.flow import FINAL_CHUNK_MODES, FinalChunk
from cosyedge_models.synthesis.flow_gather import MAX_GATHER_MS
from cosyedge_models.synthesis.modes import GRAPH_THREAD_MODES, LLM_FIRST_CHUNK_PRIORITIES, MAX_PARALLEL_PREFILLS


@dataclass(frozen=True)
class SynthesisSettings:
    backend: str = "ort"
    # None: the bundle's own, but on ort-cuda the faster of fp32/fp16 where the bundle records
    # both measured (models/bundle/precision_speed.py); "fp32"/"fp16"/"int8" pick that variant.
    precision: str | None = None
    max_text_chars: int = MAX_TEXT_CHARS
    threads: int | None = None  # intra-op threads per session (None: the runtime's default)
    first_hop_tokens: int | None = None  # None: upstream's aligned first hop
    # Euler steps of the first streaming chunk (sooner first audio, a coarser first chunk; the
    # later chunks are unchanged, models/synthesis/flow.py FlowStream); None: the bundle's n_timesteps.
    first_chunk_euler_steps: int | None = None
    # After each streaming chunk the hop grows by this factor up to 4x (upstream's
    # stream_scale_factor); 1.0: a fixed hop, as CosyVoice 2 upstream.
    hop_scale: float = 1.0
    # The grown hop's cap in speech tokens; None: 4 x the hop (upstream). On the GPU a cap whose chunks fit the
    # bundle's largest fixed-shape estimator window keeps them on the captured graphs (a warning at load says).
    max_hop_tokens: int | None = None
    batching: BatchSettings | None = None  # None: every request decodes alone (batch 1)
    # Flow estimator and HiFT calls of concurrent requests merged into one run
    # (models/batching/stage_batcher.py); max_batch_size counts requests. None: each runs alone.
    flow_batching: BatchSettings | None = None
    # Streaming: the LLM on a producer thread while flow + vocoder run (False: serial).
    # None: auto (resolve_overlap): on with a GPU backend or >= 4 CPU cores.
    overlap_stages: bool | None = None
    # Cap on LLM producer threads; they start only as concurrent streams need them
    # (>= the Triton model's max_batch_size, so its batch runs fully in parallel).
    producer_threads: int = 16
    overlap_queue_tokens: int = 128  # how far (in tokens) the LLM may run ahead of flow + vocoder
    # Streaming's last chunk: "cached" runs it through the estimator caches like
    # the others (linear cost: streaming costs about what offline does; its
    # frames differ slightly from upstream's); "upstream" reproduces upstream
    # exactly with a full-length non-streaming pass (streaming then costs about
    # twice offline).
    flow_final_chunk: FinalChunk = "cached"
    # Streaming flow's left context in mask chunks (50 frames = 1 s each): -1
    # (default) all earlier frames, exactly as upstream; N >= 0 keeps only the
    # last N chunks in the estimator caches, which bounds their memory (about
    # 219 MiB per second of audio at full size) for long utterances on 8 GB
    # boards but CHANGES the output (no longer upstream's mel).
    flow_left_chunks: int = -1
    # The LLM's fixed-size decode step, captured as CUDA graphs on ort-cuda
    # (bundles exported with --static-decode-len): None auto (on for ort-cuda
    # when the bundle has it), True also on the CPU (no capture: for tests), False off.
    graph_decode: bool | None = None
    graph_decode_slots: int = 4  # requests decoding with it at once; more use the ordinary loop
    # With `batching` and the fixed-size decode on: the LLM batch runs through the iteration-level
    # scheduler over the fixed-shape step (models/batching/graph_batcher.py; rows: graph_decode_slots)
    # instead of the dynamic-graph batcher. Off by default until the batched step graph replaces the
    # per-stream one (models/batching/looped_step.py: one replay per stream, as without batching).
    graph_batching: bool = False
    # With graph_batching: a running stream waits for at most this many new requests' prefills
    # between two of its decode steps. 8: streams that arrive together then start their chunks in step
    # and share the flow's batched replays (H200, eleventh and twelfth runs: 8 streams' first audio p95
    # 799 ms against 953 ms with 1, every stream faster than real time; docs/gpu.md).
    llm_prefills_between_steps: int = 8
    # With graph_batching: the graph-thread class of a batched LLM step that samples some stream's
    # first-chunk tokens (LLM_FIRST_CHUNK_PRIORITIES). "normal": behind every first chunk's flow replay
    # waiting, so the streams that got their tokens first speak first; "first_audio": in arrival order
    # with those replays, so later streams' first-chunk tokens are not held behind earlier streams' flows
    # (H200, fourteenth run at 8 streams: the last first-chunk tokens at 710 ms with "normal").
    llm_first_chunk_priority: str = "normal"
    # With graph_batching: a round's new requests' prefills run on up to this many threads at once
    # (each an onnxruntime run of the dynamic LLM graph; on a GPU bound by kernel launches: ~11 ms for a
    # saved voice's 291 positions on the H200, fourteenth run, so eight streams' first steps waited ~88
    # ms for the prefills one after another). 1: one after another. 4: the fifteenth run's eight and
    # sixteen streams' p95 lower than with 1 (docs/gpu.md), no change for one stream.
    llm_parallel_prefills: int = 4
    # With graph_batching on the fused step: a round's new prompts of one prefix length in ONE prefill run
    # (right-padded; each row's last prompt position is its first step's input). Eight prefills cost 95-142
    # ms before the first chunks' first step on the H200 (fifteenth run); off until a run measures this.
    llm_batched_prefill: bool = False
    # With graph_batching on the fused step: each new prompt through the bundle's fixed-length prefill graph
    # that fits it (--fused-prefill-lengths), captured on ort-cuda, on the graph thread: ~300 kernels
    # instead of the dynamic graph's run. Measured on the H200 (docs/gpu.md, twenty-first run): one prompt
    # 5-7 ms against 11-16, but sixteen streams' prompts wait behind the graph thread's replays (167-219
    # ms against 119-134): off by default.
    llm_captured_prefill: bool = False
    # Per-voice prompt caches (models/synthesis/voice_cache.py) for saved voices, in MiB
    # (host memory; about 4.4 MiB per prompt mel frame at full size in fp32); 0: off.
    voice_cache_mb: int = 2048
    # The flow estimator's fixed-shape graphs replayed as CUDA graphs on ort-cuda (bundles
    # exported with --static-flow-windows; not with flow batching), all on the engine's GPU graph
    # thread: None auto (on for ort-cuda, with as many of graph_flow_slots as fit in a quarter of
    # the GPU's memory; off when none fits), True on (on the CPU without capture), False off.
    # Every slot is allocated and captured at load.
    graph_flow: bool | None = None
    # Streaming requests on them at once (more use the dynamic graph); each takes
    # n_timesteps x cache_frames x K/V row bytes of device memory from load on (470 MB per
    # Euler step at full size with 1024 frames: 4.7 GB a request), and one encoder slot (29 MB).
    graph_flow_slots: int = 8
    # With graph_flow on onnxruntime and a bundle exported with --batch-flow-sizes: concurrent
    # streams' estimator windows of the same size at the same Euler step run as one batched
    # replay on the graph thread (models/batching/flow_batcher.py; as many streams as the largest
    # batch size, more take graph_flow's slots). Off by default until measured on the GPU.
    graph_flow_batch: bool = False
    # With graph_flow_batch's lanes: single-stream fixed-shape slots made beside them for the streams beyond
    # the lanes (at most graph_flow_slots). On an 80 GB card at full size the default two took 15.2 GB (fp32
    # caches, sessions and captures), and with the batched encoder windows that left room for 8 lanes where 0
    # slots leave room for 16 (docs/gpu.md, twenty-sixth run): 0 puts every stream on a lane (the seats are the
    # lanes; a stream that finds no lane takes the dynamic graph).
    graph_flow_overflow_slots: int = OVERFLOW_FLOW_SLOTS
    # With graph_flow_batch's lanes: a later chunk's flow waits up to this long (and only out of the audio its
    # stream has queued ahead of playback) for other streams' chunks, so that their Euler steps run as shared
    # replays (models/synthesis/flow_gather.py: at sixteen streams most replays served one stream, docs/gpu.md,
    # twenty-seventh run). 0: off (the default until measured on the GPU).
    graph_flow_gather_ms: float = 0.0
    # With graph_flow_batch's lanes and a bundle that has the batched encoder graphs (exported with
    # --batch-flow-sizes since issue 23): concurrent streams' flow encoder calls waiting together run as
    # one batched replay (models/batching/batched_encoder.py; as many streams as the largest batch size,
    # more take the single-stream encoder slots). Measured on the H200 (docs/gpu.md, twenty-first run):
    # within the runs' spread at eight and sixteen streams: off by default.
    graph_encoder_batch: bool = False
    # With the fixed-length vocoder graphs and a bundle that has their batched graphs (exported with
    # --static-vocoder and --batch-flow-sizes): concurrent streams' chunks of one length waiting together run
    # as one batched replay (models/batching/batched_vocoder.py). Off by default until measured on the GPU.
    graph_vocoder_batch: bool = False
    # Offline (stream=false) requests synthesized as streams whose pieces are joined, so that the
    # streams' batched GPU work (graph_flow_batch's lanes, the vocoder's fixed lengths) serves them
    # too; the audio is then what a streamed request gives (chunk-causal flow) instead of one
    # whole-utterance pass, and `speed` other than 1.0 still takes the offline path. None: auto (on
    # where graph_flow_batch's lanes are loaded), True / False on / off.
    offline_as_stream: bool | None = None
    # The streaming flow encoder's fixed-shape graphs (exported with the estimator's), one slot a
    # request, replayed on the same graph thread: None auto (with graph_flow's estimator graphs),
    # False keeps the encoder on its dynamic graph on each request's own thread (it then does not
    # queue behind other streams' replays; 8 ms slower per chunk on an H200, docs/gpu.md).
    graph_encoder: bool | None = None
    # Sessions per vocoder graph, each kept on one input shape (models/backends/shape_pinned.py):
    # None auto (3 on ort-cuda, where a shape change costs ~150 ms a call; else 1).
    vocoder_sessions: int | None = None
    # The fixed-length vocoder graphs (bundles exported with --static-vocoder: the first and the
    # steady streaming chunk) replayed as CUDA graphs on the engine's GPU graph thread, not with
    # flow batching: None auto (on for ort-cuda), True on (on the CPU without capture), False off.
    graph_vocoder: bool | None = None
    # With those graphs: a stream's last chunk (any length) right-padded into the shortest one that
    # holds it and its audio cut back, instead of the dynamic sessions at its exact length (150-200
    # ms a graph on the CUDA provider at a length new to it: ~0.55 s at the end of every stream on
    # the H200). HiFT is not causal: the chunk's last frames differ (~0.17 s, 21 dB SNR over the last
    # chunk on the tiny model; docs/gpu.md). None: auto (on for ort-cuda, where that set-up cost is).
    vocoder_pad_final: bool | None = None
    # "one": every captured stage (LLM step, flow windows, vocoder) replays on one GPU graph
    # thread, one replay at a time; "per-stage": a thread each, so streams' LLM steps and flow
    # windows can overlap on the GPU (captures still happen at load, one stage after another;
    # first-audio holds then apply to the flow and vocoder threads only, not to the LLM's).
    graph_threads: str = "one"
    # "The first chunk first": a streaming request's first chunk's flow and vocoder run ahead of
    # other work on the graph thread(s), and the LLM's captured decode steps (every stream's)
    # wait while it runs (bounded; models/backends/graph_thread.py). False: submission order.
    first_audio_first: bool = True
    # onnxruntime's CPU memory arena for host tensors (the ort backends): True keeps the peak of
    # every run allocated for the process's life (2-6% faster at full size on 2 cores); False
    # (default) frees them as they go: 0.24x instead of 0.35x of the fp32 engine's memory for the
    # int8 bundle after a request, 3.9 instead of 5.7 GiB after a 31 s offline one (docs/memory.md).
    cpu_memory_arena: bool = False

    def __post_init__(self) -> None:
        if self.max_text_chars < 1:
            raise ValueError(f"max_text_chars must be >= 1, got {self.max_text_chars}")
        if self.hop_scale < 1.0:
            raise ValueError(f"hop_scale must be >= 1.0, got {self.hop_scale}")
        if self.max_hop_tokens is not None and self.max_hop_tokens < 1:
            raise ValueError(f"max_hop_tokens must be >= 1 or None (4 x the hop), got {self.max_hop_tokens}")
        if self.first_hop_tokens is not None and self.first_hop_tokens < 1:
            raise ValueError(f"first_hop_tokens must be >= 1 or None, got {self.first_hop_tokens}")
        if self.first_chunk_euler_steps is not None and self.first_chunk_euler_steps < 1:
            raise ValueError(f"first_chunk_euler_steps must be >= 1 or None (the bundle's n_timesteps), "
                             f"got {self.first_chunk_euler_steps}")
        if self.batching is not None and not isinstance(self.batching, BatchSettings):
            raise ValueError(f"batching must be a BatchSettings or None, got {type(self.batching).__name__}")
        if self.flow_batching is not None and not isinstance(self.flow_batching, BatchSettings):
            raise ValueError(f"flow_batching must be a BatchSettings or None, got {type(self.flow_batching).__name__}")
        if self.producer_threads < 1:
            raise ValueError(f"producer_threads must be >= 1, got {self.producer_threads}")
        if self.overlap_queue_tokens < 1:
            raise ValueError(f"overlap_queue_tokens must be >= 1, got {self.overlap_queue_tokens}")
        if self.flow_left_chunks < -1:
            raise ValueError(f"flow_left_chunks must be -1 (full left context) or >= 0, got {self.flow_left_chunks}")
        if self.voice_cache_mb < 0:
            raise ValueError(f"voice_cache_mb must be >= 0 (0: off), got {self.voice_cache_mb}")
        if self.graph_decode_slots < 1:
            raise ValueError(f"graph_decode_slots must be >= 1, got {self.graph_decode_slots}")
        if self.llm_first_chunk_priority not in LLM_FIRST_CHUNK_PRIORITIES:
            raise ValueError(f"llm_first_chunk_priority must be one of {', '.join(LLM_FIRST_CHUNK_PRIORITIES)}, "
                             f"got {self.llm_first_chunk_priority!r}")
        if not 1 <= self.llm_parallel_prefills <= MAX_PARALLEL_PREFILLS:
            raise ValueError(f"llm_parallel_prefills must be 1 .. {MAX_PARALLEL_PREFILLS} threads, "
                             f"got {self.llm_parallel_prefills}")
        if self.llm_prefills_between_steps < 1:
            raise ValueError(f"llm_prefills_between_steps must be >= 1 prefill, got {self.llm_prefills_between_steps}")
        if self.vocoder_sessions is not None and self.vocoder_sessions < 1:
            raise ValueError(f"vocoder_sessions must be >= 1 or None, got {self.vocoder_sessions}")
        if self.graph_flow_slots < 1:
            raise ValueError(f"graph_flow_slots must be >= 1, got {self.graph_flow_slots}")
        if self.graph_flow_overflow_slots < 0:
            raise ValueError(f"graph_flow_overflow_slots must be >= 0 streams (0: every stream on a batched lane), "
                             f"got {self.graph_flow_overflow_slots}")
        if not 0 <= self.graph_flow_gather_ms <= MAX_GATHER_MS:
            raise ValueError(f"graph_flow_gather_ms must be 0 (off) to {MAX_GATHER_MS:.0f} ms, "
                             f"got {self.graph_flow_gather_ms}")
        if self.graph_threads not in GRAPH_THREAD_MODES:
            raise ValueError(f"graph_threads must be one of {', '.join(GRAPH_THREAD_MODES)}, "
                             f"got {self.graph_threads!r}")
        if self.flow_final_chunk not in FINAL_CHUNK_MODES:
            raise ValueError(f"flow_final_chunk must be one of {', '.join(FINAL_CHUNK_MODES)}, "
                             f"got {self.flow_final_chunk!r}")
