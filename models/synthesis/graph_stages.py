"""The engine's CUDA-graph stages: the LLM's fixed-size decode step
(models/backends/ort_graph_decode.py) and the fixed-shape flow estimator
graphs (models/backends/ort_static_flow.py), and the one GPU graph thread
(models/backends/graph_thread.py) that captures them at load and runs every
replay. Made by CosyVoiceSynthesizer; closed by it after their users stop and
before it closes the sessions."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

from cosyedge_models.backends.base import FixedSizeDecode, Session
from cosyedge_models.backends.graph_thread import GraphThread
from cosyedge_models.backends.profiling import GraphTrace
from cosyedge_models.bundle.loader import Bundle
from cosyedge_models.errors import BundleError, SynthesisError
from cosyedge_models.synthesis.flow_gather import FlowGather, hold_budget_s, queued_audio_s
from cosyedge_models.synthesis.settings import SynthesisSettings

if TYPE_CHECKING:  # onnxruntime is imported only where a stage is on (the trt backend runs without it)
    from cosyedge_models.backends.encoder_cache import EncoderCacheSpec
    from cosyedge_models.backends.ort_graph_decode import GraphDecoder
    from cosyedge_models.backends.ort_static_encoder import StaticEncoderGraphs
    from cosyedge_models.backends.ort_static_flow import StaticFlowGraphs
    from cosyedge_models.backends.ort_static_vocoder import StaticVocoder
    from cosyedge_models.backends.tensorrt.static_encoder import TrtStaticEncoder
    from cosyedge_models.backends.tensorrt.static_flow import TrtStaticFlow
    from cosyedge_models.backends.tensorrt.static_vocoder import TrtStaticVocoder
    from cosyedge_models.batching.batched_encoder import BatchEncoderGraphs
    from cosyedge_models.batching.batched_vocoder import BatchedVocoder
    from cosyedge_models.batching.flow_batcher import BatchedFlowCaches, FlowBatcher
    from cosyedge_models.batching.fused_step import FusedDecodeStep
    from cosyedge_models.batching.seats import StreamSeats
    from cosyedge_models.synthesis.request_state import RequestState

log = logging.getLogger(__name__)

StageT = TypeVar("StageT")


class GraphStages:
    """Loads the graph stages an engine's settings and bundle ask for; the
    graph thread is started on first need (no stage: no thread)."""

    def __init__(self, bundle: Bundle, backend_name: str, settings: SynthesisSettings,
                 load: Callable[[str], Session]) -> None:
        self.bundle = bundle
        self.backend_name = backend_name
        self.settings = settings
        self._load = load
        self.threads: dict[str, GraphThread] = {}  # by stage; one object for all in "one" mode
        self.decode: GraphDecoder | None = None
        self.flow: StaticFlowGraphs | TrtStaticFlow | None = None
        self.encoder: StaticEncoderGraphs | TrtStaticEncoder | None = None
        self.vocoder: StaticVocoder | TrtStaticVocoder | BatchedVocoder | None = None
        self.vocoder_batch: BatchedVocoder | None = None  # the batched vocoder graphs (graph_vocoder_batch)
        self.flow_batch: FlowBatcher | None = None  # the batched estimator windows (graph_flow_batch)
        self.flow_seats: StreamSeats | None = None  # the streams they and the single-stream slots serve at once
        self.flow_gather: FlowGather | None = None  # later chunks' flow starts held together (graph_flow_gather_ms)
        self.encoder_batch: BatchEncoderGraphs | None = None  # the batched encoder windows (graph_encoder_batch)
        # seconds each stage took to load, make its slots and capture its graphs (bench, logs):
        # at full size on an H200 most of an engine's load (docs/gpu.md, fifth run)
        self.load_seconds: dict[str, float] = {}
        # the GPU's memory in use (all processes) after each stage loaded, on a CUDA backend (bench, logs):
        # where an engine's memory went when a GPU runs out (an H100 did at full size, 2026-12-05)
        self.device_used_bytes: dict[str, int] = {}
        # per-stage threads: first chunks whose hold took the LLM step's thread too (a lone stream)
        self.lone_holds = 0
        self._lone_lock = threading.Lock()

    def _loaded(self, stage: str, t0: float, made: StageT) -> StageT:
        """`made` (a loaded stage, or None), its load time noted and logged."""
        if made is not None:
            self.load_seconds[stage] = round(time.perf_counter() - t0, 2)
            used = self._device_used()
            if used is not None:
                self.device_used_bytes[stage] = used
            log.info("graph stage %s: loaded, slots made and graphs captured in %.1f s%s", stage,
                     self.load_seconds[stage], "" if used is None else f"; {used / 1e9:.1f} GB of the GPU in use")
        return made

    def _device_used(self) -> int | None:
        if self.backend_name == "ort":  # the CPU provider; ort-cuda, ort-trt and trt hold the GPU
            return None
        from cosyedge_models.backends.gpu_probe import device_memory_used

        return device_memory_used(0)  # the engine's GPU: create_backend's device, 0 wherever an engine is made

    @property
    def thread(self) -> GraphThread | None:
        """The one graph thread (None before a stage needs it, and in "per-stage" mode)."""
        if self.settings.graph_threads != "one" or not self.threads:
            return None
        return next(iter(self.threads.values()))

    def _thread(self, stage: str) -> GraphThread:
        if stage not in self.threads:
            shared = self.settings.graph_threads == "one" and self.threads
            # per stage, a thread named by its stage (the bench's CPU time by thread tells them apart)
            name = "cosyedge-cuda-graphs" if self.settings.graph_threads == "one" else f"cosyedge-{stage}-graphs"
            self.threads[stage] = next(iter(self.threads.values())) if shared else GraphThread(name).start()
        return self.threads[stage]

    @property
    def holds_first_audio(self) -> bool:
        """Whether first_audio() opens holds: a graph thread exists and first_audio_first is on."""
        return self.settings.first_audio_first and bool(self.threads)

    def first_audio_threads(self, llm_streams: int | None = None) -> list[GraphThread]:
        """The graph threads a first chunk's hold applies to: the one thread, or ("per-stage")
        those of the flow and vocoder stages. A hold orders a queue that first-audio work shares
        with LLM steps; the LLM step's own thread has no such work to put first, and holding it
        would stall the streams that already speak (their later chunks' tokens) and the streams
        behind (their first chunks' tokens) whenever some first chunk is on its way. Where the
        requester is the LLM's only stream (`llm_streams` <= 1; None: not known) it stalls nobody but
        its own later tokens, and those steps would share the GPU with its first chunk's replays (the
        first chunk's flow 80 ms against 64 on one thread at one stream, H200, twenty-first run): the
        LLM step's thread is held too."""
        one = self.settings.graph_threads == "one"
        lone = llm_streams is not None and llm_streams <= 1
        return list({id(t): t for stage, t in self.threads.items() if one or lone or stage != "decode"}.values())

    @contextlib.contextmanager
    def first_audio(self, llm_streams: int | None = None) -> Iterator[None]:
        """A request's first chunk (flow and vocoder) on its way to the first audio: its graph
        work runs first, and LLM steps that share its thread wait (GraphThread.first_audio), on
        first_audio_threads(llm_streams); nothing when holds_first_audio is False."""
        with contextlib.ExitStack() as stack:
            if self.holds_first_audio:
                threads = self.first_audio_threads(llm_streams)
                if self.settings.graph_threads != "one" and self.threads.get("decode") in threads:
                    with self._lone_lock:
                        self.lone_holds += 1
                for thread in threads:
                    stack.enter_context(thread.first_audio())
            yield

    def order_stats(self) -> dict[str, dict[str, object]]:
        """Each graph thread's ordering counters (GraphThread.order_stats), by its stages."""
        by_thread: dict[int, list[str]] = {}
        for stage, thread in self.threads.items():
            by_thread.setdefault(id(thread), []).append(stage)
        threads = {id(t): t for t in self.threads.values()}
        return {"+".join(stages): threads[key].order_stats() for key, stages in by_thread.items()}

    def settle(self) -> None:
        """Wait for the work requests queued at their ends (the flow lanes' end-of-stream writes): a bench
        level's own, in its figures, not the next level's."""
        if self.flow_batch is not None:
            self.flow_batch.lanes.settle()

    def record_trace(self, trace: GraphTrace | None) -> None:
        """Every graph thread records the items it runs into `trace` from now on (None: stops)."""
        for thread in self.threads.values():
            thread.trace = trace

    def flow_batch_stats(self) -> dict[str, object] | None:
        """What the batched estimator windows did (FlowBatchStats: replays, rows shared) and their seats
        (SeatStats), or None (off)."""
        if self.flow_batch is None:
            return None
        return {**self.flow_batch.report(), **(self.flow_seats.report() if self.flow_seats is not None else {}),
                **(self.flow_gather.report() if self.flow_gather is not None else {})}

    def gather_budget_s(self, state: RequestState) -> float:
        """Before a chunk's flow: how long it may hold for other streams' chunks (FlowGather, with
        graph_flow_gather_ms): a later chunk of a stream with audio queued ahead of playback; else 0."""
        first_audio_ms = state.times.first_audio_ms
        if self.flow_gather is None or first_audio_ms is None or not state.first_audio:
            return 0.0
        queued = queued_audio_s(state.audio_sent_s, state.started + first_audio_ms / 1e3, time.perf_counter())
        return hold_budget_s(self.flow_gather.max_hold_s, queued)

    def encoder_batch_stats(self) -> dict[str, int] | None:
        """What the batched encoder windows did (EncoderBatchStats), or None (off)."""
        return None if self.encoder_batch is None else self.encoder_batch.stats.as_dict()

    def vocoder_batch_stats(self) -> dict[str, int] | None:
        """What the batched vocoder graphs did (VocoderBatchStats), or None (off)."""
        return None if self.vocoder_batch is None else self.vocoder_batch.stats.as_dict()

    def fixed_size_decode(self, prefill: Session, decode: Session | None = None) -> FixedSizeDecode | None:
        """The LLM's fixed-size step over `prefill`, captured now, or None (the ordinary loop);
        with `decode` (the dynamic llm_decode) a request may start from a voice's saved LLM prefix."""
        t0 = time.perf_counter()
        setting = self.settings.graph_decode
        has_step = "llm_decode_static" in self.bundle.stages
        if setting is True and not has_step:
            raise BundleError(f"{self.bundle.root}: graph_decode needs a bundle exported with "
                              "'cosyedge build export --static-decode-len N'")
        on = setting if setting is not None else self.backend_name == "ort-cuda"
        if not (on and has_step and self.backend_name.startswith("ort")):
            return None
        from cosyedge_models.backends.ort import OrtSession
        from cosyedge_models.backends.ort_graph_decode import GraphDecoder

        step, pad = self._load("llm_decode_static"), self._load("llm_kv_pad")
        if not (isinstance(step, OrtSession) and isinstance(pad, OrtSession) and isinstance(prefill, OrtSession)):
            return None  # a wrapped backend (tests): the ordinary loop
        device = ("cuda", step.device_id) if step.on_device else ("cpu", 0)
        log.info("LLM decode: fixed-size step of %s positions%s", step.input_shapes["past_kv"][4],
                 ", CUDA graphs" if step.cuda_graph else "")
        self.decode = GraphDecoder(prefill, step, pad, device, self._thread("decode"), self.settings.graph_decode_slots,
                                   decode if isinstance(decode, OrtSession) else None)
        self.decode.warm_up()  # captures now, before any request runs
        return self._loaded("decode", t0, self.decode)

    def fused_step(self, prefill: Session, decode: Session | None = None) -> FusedDecodeStep | None:
        """With graph_batching on onnxruntime: the bundle's fused batched LLM step (the fp16 graphs
        on ort-cuda, fused_step.load_fused_step), captured now on the decode graph thread, for the
        engine's iteration-level batcher; None where the bundle has none the provider runs."""
        t0 = time.perf_counter()
        if not self.settings.graph_batching or not self.backend_name.startswith("ort"):
            return None
        from cosyedge_models.backends.ort import OrtSession
        from cosyedge_models.batching.fused_step import load_fused_step

        if not isinstance(prefill, OrtSession):
            return None  # a wrapped backend (tests): the looped step
        device = ("cuda", prefill.device_id) if prefill.on_device else ("cpu", 0)
        step = load_fused_step(self.bundle.root, self.bundle.manifest, prefill, prefill.providers, device,
                               self.settings.threads, decode=decode if isinstance(decode, OrtSession) else None,
                               captured_prefill=self.settings.llm_captured_prefill)
        if step is None:
            return None
        try:
            self._thread("decode").call(step.warm_up)  # captures each batch size now, before any request runs
        except Exception as exc:  # as a refused capture of another stage: off, the looped step serves
            step.close()
            log.warning("LLM decode: the fused batched step failed its warm-up/capture, off (%s: %s)",
                        type(exc).__name__, exc)
            return None
        log.info("LLM decode: fused batched step for batch sizes %s, %d rows of %d positions, KV %s",
                 list(step.batch_sizes), step.rows, step.positions, step.kv_dtype)
        return self._loaded("fused_decode", t0, step)

    def static_flow(self) -> StaticFlowGraphs | TrtStaticFlow | None:
        """The fixed-shape estimator graphs (onnxruntime) or engines (trt), captured now, or
        None (not with flow batching)."""
        t0 = time.perf_counter()
        if self.settings.flow_batching is not None or not self.backend_name.startswith(("ort", "trt")):
            if self.settings.flow_batching is not None and self.backend_name == "ort-cuda":
                # measured on an H200: 8 streams' first audio p95 17.2 s batched against 1.6 s on
                # the captured graphs (docs/gpu.md), so say so where someone turns it on
                log.warning("flow batching on ort-cuda runs the flow and the vocoder on the dynamic graphs, "
                            "without the fixed-shape CUDA graphs: much slower on a GPU (docs/gpu.md); "
                            "set [tts] flow_max_batch_size = 0 to keep them")
            return None
        if self.backend_name == "trt":  # TensorRT's engines: no onnxruntime on this path
            from cosyedge_models.backends.tensorrt.static_flow import load_trt_static_flow

            self.flow = load_trt_static_flow(self.bundle, self.backend_name, self._load, self.settings.graph_flow,
                                             self.settings.graph_flow_slots, functools.partial(self._thread, "flow"))
            return self._loaded("flow", t0, self.flow)
        from cosyedge_models.backends.ort_static_flow import load_static_flow
        from cosyedge_models.bundle.loader import BATCH_FLOW_PREFIX

        slots = self.settings.graph_flow_slots
        if self.settings.graph_flow_batch and any(name.startswith(BATCH_FLOW_PREFIX) for name in self.bundle.stages):
            slots = min(slots, self.settings.graph_flow_overflow_slots)  # the batched lanes hold the streams
        self.flow = load_static_flow(self.bundle, self.backend_name, self._load, self.settings.graph_flow,
                                     slots, functools.partial(self._thread, "flow"))
        return self._loaded("flow", t0, self.flow)

    def batched_flow(self) -> BatchedFlowCaches | None:
        """With graph_flow_batch and the fixed-shape estimator graphs on onnxruntime (call static_flow
        first): the batched estimator windows, captured now, as the flow's cache factory (streams
        beyond their lanes take static_flow's slots), or None."""
        made = self._batched_flow()
        if made is None and self.settings.graph_flow_batch and self.flow is not None and self.flow.max_slots == 0:
            log.warning("graph_flow_batch: no batched lanes, and graph_flow_overflow_slots = 0 left no single-stream "
                        "fixed-shape slot: every stream runs the dynamic estimator graph (slower, more GPU memory)")
        return made

    def _batched_flow(self) -> BatchedFlowCaches | None:
        t0 = time.perf_counter()
        from cosyedge_models.backends.ort_static_flow import StaticFlowGraphs

        if not self.settings.graph_flow_batch:
            return None
        if not isinstance(self.flow, StaticFlowGraphs) or self.flow.disabled is not None:
            log.info("graph_flow_batch: off, it needs graph_flow's fixed-shape estimator graphs on onnxruntime")
            return None
        from cosyedge_models.backends.ort import OrtSession
        from cosyedge_models.batching.batched_flow import BatchFlowGraphs, batch_flow_sessions, lane_bytes
        from cosyedge_models.batching.flow_batcher import BatchedFlowCaches, FlowBatcher, dynamic_cache_factory
        from cosyedge_models.batching.seats import StreamSeats

        loaded = batch_flow_sessions(self.bundle, lambda name, _path: self._load(name))
        sessions = {key: s for key, s in loaded.items() if isinstance(s, OrtSession)}
        if not loaded or len(sessions) != len(loaded):
            if not loaded:
                raise BundleError(f"{self.bundle.root}: graph_flow_batch needs a bundle exported with "
                                  "'cosyedge build export --static-flow-windows W,... --batch-flow-sizes 1,2,...'")
            return None  # a wrapped backend (tests)
        flow = self.flow
        groups = self.bundle.flow.n_timesteps
        lanes = max(b for b, _ in sessions)
        if flow.device[0] == "cuda":  # the lanes that fit the GPU's memory now (batch_lanes)
            from cosyedge_models.backends.fixed_shapes import (
                BATCH_LANE_FRACTION,
                ENCODER_BATCH_LANES,
                LATER_STAGES_LANES,
                MOVED_STREAM_LANES,
                VOCODER_BATCH_LANES,
                batch_lanes,
                device_total_bytes,
                step_captures_bytes,
            )
            from cosyedge_models.backends.gpu_probe import device_memory_used

            per_lane, total = lane_bytes(sessions, groups), device_total_bytes(flow.device[1])
            windows = len({w for _, w in sessions})
            used = device_memory_used(flow.device[1])
            if total:
                free = total - used if used is not None else total
                # the stages loaded after the lanes (H100, twenty-second run: 16 lanes left 3.8 GB, too little to
                # serve), and one long stream moved to the dynamic estimator graph (twenty-seventh run)
                later = int(per_lane * (LATER_STAGES_LANES + MOVED_STREAM_LANES
                                        + (ENCODER_BATCH_LANES if self._encoder_lanes() else 0)
                                        + (VOCODER_BATCH_LANES if self.settings.graph_vocoder_batch else 0)))
                lanes = batch_lanes(sorted({b for b, _ in sessions}), per_lane, total, free, groups=groups,
                                    windows=windows, later_bytes=later)
            if lanes < 2:
                log.warning("graph_flow_batch: off, a stream's batched caches take %.1f GB and two do not fit in "
                            "%.0f%% of the GPU's %.1f GB nor in the %.1f GB free (export a smaller "
                            "--static-flow-cache)", per_lane / 1e9, BATCH_LANE_FRACTION * 100, total / 1e9,
                            (total - (used or 0)) / 1e9)
                return None
            log.info("graph_flow_batch: %d lanes of %.2f GB each (with their captures %.2f GB), %.1f GB of the "
                     "GPU's %.1f GB in use", lanes, per_lane / 1e9,
                     (per_lane + step_captures_bytes(groups, windows)) / 1e9,
                     (used or 0) / 1e9, total / 1e9)
        thread = self._thread("flow")
        graphs = thread.call(lambda: BatchFlowGraphs(sessions, flow.device, flow.copier, lanes, groups))
        try:
            thread.call(graphs.warm_up)  # captures now, before any request runs
        except SynthesisError as exc:
            # a GPU the sizing misjudged (out of memory while capturing): the engine still loads, the
            # single-stream slots and the dynamic graph serve, and the lanes' memory goes back now
            graphs.close()
            for session in sessions.values():
                session.close()
            log.warning("graph_flow_batch: off, capturing %d batched lanes failed (the single-stream slots, for %d "
                        "requests, and the dynamic graph serve every stream): %s", lanes,
                        flow.max_slots // max(1, groups), exc)
            return None
        except BaseException:
            graphs.close()  # the lanes' memory goes back before the error reaches the caller
            raise
        self.flow_batch = FlowBatcher(graphs, thread)
        log.info("flow estimator: batched windows %s for batch sizes %s, %d streams, %d cached frames",
                 graphs.windows, graphs.batch_sizes, graphs.lanes, graphs.cache_frames)
        self._loaded("flow_batch", t0, graphs)
        # a stream beyond the lanes and the single-stream slots waits for one (FlowDecoder.seats), not the
        # dynamic graph
        self.flow_seats = seats = StreamSeats(graphs.lanes + flow.max_slots // max(1, groups))
        if self.settings.graph_flow_gather_ms > 0:
            self.flow_gather = FlowGather(self.settings.graph_flow_gather_ms / 1e3, lambda: seats.count - seats.free,
                                          self.flow_batch.expect)
        return BatchedFlowCaches(self.flow_batch, flow, dynamic_cache_factory(flow.copier))

    def static_encoder(self, spec: EncoderCacheSpec) -> StaticEncoderGraphs | TrtStaticEncoder | None:
        """The fixed-shape streaming encoder graphs (onnxruntime) or engines (trt), captured now,
        with a slot for each request the estimator's serve (the single-stream slots and the
        batched lanes), or None: they go with those (call static_flow and batched_flow first)."""
        t0 = time.perf_counter()
        if (self.settings.graph_encoder is False or self.flow is None or self.flow.disabled is not None
                or not self.backend_name.startswith(("ort", "trt"))):
            return None
        slots = max(1, self.flow.max_slots // self.bundle.flow.n_timesteps)
        if self.flow_batch is not None and not self._encoder_lanes():
            slots += self.flow_batch.graphs.lanes  # a stream in the lanes needs an encoder slot too
        if self.backend_name == "trt":  # TensorRT's engines: no onnxruntime on this path
            from cosyedge_models.backends.tensorrt.static_encoder import load_trt_static_encoder

            self.encoder = load_trt_static_encoder(self.bundle, self.backend_name, self._load,
                                                   self.settings.graph_flow, slots, spec,
                                                   functools.partial(self._thread, "flow"))
            return self._loaded("encoder", t0, self.encoder)
        from cosyedge_models.backends.ort_static_encoder import load_static_encoder

        self.encoder = load_static_encoder(self.bundle, self.backend_name, self._load, self.settings.graph_flow,
                                           slots, spec, functools.partial(self._thread, "flow"))
        return self._loaded("encoder", t0, self.encoder)

    def _encoder_lanes(self) -> bool:
        """Whether batched_encoder will give the streams in graph_flow_batch's lanes encoder lanes of their
        own (graph_encoder_batch and the bundle's batched encoder graphs on onnxruntime)."""
        from cosyedge_models.bundle.loader import BATCH_ENCODER_NAME

        return (self.settings.graph_encoder_batch and self.backend_name.startswith("ort")
                and any(BATCH_ENCODER_NAME.match(str(n)) for n in self.bundle.stages))

    def batched_encoder(self, spec: EncoderCacheSpec) -> BatchEncoderGraphs | None:
        """With graph_encoder_batch, graph_flow_batch's lanes and the fixed-shape encoder graphs on
        onnxruntime (call static_encoder first): the batched encoder windows, captured now, as the
        flow's encoder cache factory (streams beyond their lanes take static_encoder's slots), or None."""
        t0 = time.perf_counter()
        if not self.settings.graph_encoder_batch:
            return None
        from cosyedge_models.backends.ort_static_encoder import StaticEncoderGraphs

        if self.flow_batch is None or not isinstance(self.encoder, StaticEncoderGraphs) or self.encoder.disabled:
            log.info("graph_encoder_batch: off, it needs graph_flow_batch's lanes and the fixed-shape encoder "
                     "graphs on onnxruntime")
            return None
        from cosyedge_models.backends.ort import OrtSession
        from cosyedge_models.batching.batched_encoder import BatchEncoderGraphs, batch_encoder_sessions

        loaded = batch_encoder_sessions(self.bundle, lambda name, _path: self._load(name))
        sessions = {key: s for key, s in loaded.items() if isinstance(s, OrtSession)}
        if not loaded:
            raise BundleError(f"{self.bundle.root}: graph_encoder_batch needs a bundle exported by this version "
                              "with '--static-flow-windows W,... --batch-flow-sizes 1,2,...' (the batched "
                              "encoder graphs)")
        if len(sessions) != len(loaded):
            return None  # a wrapped backend (tests)
        encoder = self.encoder
        thread = self._thread("flow")
        graphs = BatchEncoderGraphs(sessions, encoder.device, encoder.copier, spec, thread, encoder)
        graphs.warm_up()  # captures now, before any request runs
        if graphs.disabled is not None:
            graphs.close()
            return None
        self.encoder_batch = graphs
        log.info("flow encoder: batched windows %s tokens for batch sizes %s, %d streams, %d cached tokens",
                 graphs.windows, graphs.batch_sizes, graphs.max_slots, graphs.cache_tokens)
        return self._loaded("encoder_batch", t0, graphs)

    def static_vocoder(self) -> StaticVocoder | TrtStaticVocoder | BatchedVocoder | None:
        """The fixed-length vocoder graphs (onnxruntime) or engines (trt), captured now, or
        None (not with flow batching)."""
        t0 = time.perf_counter()
        if self.settings.flow_batching is not None or not self.backend_name.startswith(("ort", "trt")):
            return None
        if self.backend_name == "trt":  # TensorRT's engines: no onnxruntime on this path
            from cosyedge_models.backends.tensorrt.static_vocoder import load_trt_static_vocoder

            self.vocoder = load_trt_static_vocoder(self.bundle, self.backend_name, self._load,
                                                   self.settings.graph_vocoder,
                                                   functools.partial(self._thread, "vocoder"))
            return self._loaded("vocoder", t0, self.vocoder)
        from cosyedge_models.backends.ort_static_vocoder import load_static_vocoder

        single = load_static_vocoder(self.bundle, self.backend_name, self._load, self.settings.graph_vocoder,
                                     functools.partial(self._thread, "vocoder"))
        self.vocoder = single
        if single is not None and self.settings.graph_vocoder_batch and single.disabled is None:
            from cosyedge_models.batching.batched_vocoder import BatchedVocoder, with_batched_vocoder

            self.vocoder = with_batched_vocoder(single, self.bundle, self._load)
            self.vocoder_batch = self.vocoder if isinstance(self.vocoder, BatchedVocoder) else None
        return self._loaded("vocoder", t0, self.vocoder)

    def close(self) -> None:
        """Drop the slots and stop the graph thread (the engine closes the sessions after this)."""
        if self.vocoder is not None:
            self.vocoder.close()
        if self.decode is not None:
            self.decode.close()
        if self.flow is not None:
            self.flow.close()
        if self.flow_batch is not None:
            self.flow_batch.graphs.close()
        if self.encoder_batch is not None:
            self.encoder_batch.close()
        if self.encoder is not None:
            self.encoder.close()
        for thread in {id(t): t for t in self.threads.values()}.values():
            thread.close()
