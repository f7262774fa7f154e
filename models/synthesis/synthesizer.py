"""The CosyVoice 2 engine: text in, audio chunks out, over backend sessions.

One `CosyVoiceSynthesizer` serves concurrent requests: the sessions are shared
(ONNX Runtime sessions are safe to run from several threads) and every
request carries its own state (sampler, noise, chunk schedule, vocoder cache).

Streaming requests overlap their stages (SynthesisSettings.overlap_stages): the
LLM decodes on a producer thread (batched: on the batcher's worker) while the
request's own thread runs flow + vocoder on the chunk before, so time to first
audio is the first chunk's cost and throughput is bounded by the slowest
stage (models/synthesis/token_stream.py)."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import numpy as np
from cosyedge_models.backends.base import Backend, Session
from cosyedge_models.backends.encoder_cache import host_encoder_cache
from cosyedge_models.backends.factory import create_backend
from cosyedge_models.backends.graph_thread import GraphPriority
from cosyedge_models.backends.shape_pinned import ShapePinnedSession
from cosyedge_models.batching.graph_batcher import GraphBatcher, start_graph_batcher
from cosyedge_models.batching.group import RequestGroup
from cosyedge_models.batching.llm_batcher import LlmBatcher, TokenStream, start_batcher
from cosyedge_models.batching.stage_batcher import call_priority, start_stage_batching
from cosyedge_models.bundle.loader import Bundle, load_bundle
from cosyedge_models.bundle.precision_speed import AUTO_BACKENDS, auto_precision
from cosyedge_models.errors import RequestError
from cosyedge_models.synthesis.api import (
    SPEED_MAX,
    SPEED_MIN,
    AudioChunk,
    LoadLevel,
    Mode,
    StageTimes,
    SynthesisRequest,
    SynthesizeFn,
    SynthesizerDefaults,
)
from cosyedge_models.synthesis.conditioning import Conditioning, ConditioningBuilder
from cosyedge_models.synthesis.flow import EstimatorWork, FlowDecoder, FlowStream, encoder_spec, step_grid
from cosyedge_models.synthesis.graph_stages import GraphStages
from cosyedge_models.synthesis.llm import LlmInput, SpeechTokenLM
from cosyedge_models.synthesis.llm_prefix import LlmPrefix
from cosyedge_models.synthesis.modes import MODES
from cosyedge_models.synthesis.offline import joined, linear_resize
from cosyedge_models.synthesis.request_state import LlmSpans, RequestState
from cosyedge_models.synthesis.sampling import TokenSampler
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.streaming import ChunkSchedule, check_hops, stream_mel_frames
from cosyedge_models.synthesis.token_stream import ProducedTokens, ProducerPool, SerialTokens, TokenSource
from cosyedge_models.synthesis.vocoder import HiftVocoder, NoiseSource, VocoderStream
from cosyedge_models.synthesis.voice_cache import (
    MIB,
    FlowPrefix,
    VoiceCache,
    bundle_identity,
    saved_voice_llm_prefix,
    saved_voice_prefix,
)
from cosyedge_models.text.frontend import TextFrontend
from cosyedge_models.text.tokenizer import TextTokenizer

log = logging.getLogger(__name__)


def resolve_overlap(setting: bool | None, backend: str, cpu_count: int | None) -> bool:
    """Whether streaming overlaps its stages. Auto (None): on for GPU backends
    and CPUs of 4+ cores. On a 2-core CPU both stages' thread pools share the
    same two cores: measured at full size, the first chunk's flow then took 3x
    longer and time to first audio went from 2.5 s (serial) to 6.3 s."""
    if setting is not None:
        return setting
    return backend != "ort" or (cpu_count or 1) >= 4


def default_noise(seq: np.random.SeedSequence) -> NoiseSource:
    return np.random.default_rng(seq)


class CosyVoiceSynthesizer(SynthesizerDefaults):
    # The vocoder's random source per request; parity tests swap in one that
    # draws exactly what upstream's torch code draws.
    noise_factory: Callable[[np.random.SeedSequence], NoiseSource] = staticmethod(default_noise)

    def __init__(self, bundle: Bundle, backend: Backend, settings: SynthesisSettings) -> None:
        step_grid(bundle.flow.n_timesteps, settings.first_chunk_euler_steps)  # at most the bundle's: ValueError
        check_hops(bundle, settings.first_hop_tokens, settings.hop_scale, settings.max_hop_tokens)
        self.bundle = bundle
        self.settings = settings
        self.backend = backend
        self.name = f"cosyvoice-{backend.name}"
        self.sample_rate = bundle.sample_rate
        self._sessions: list[Session] = []
        load = self._load
        # The CUDA-graph stages and the one thread that captures them (now) and runs every replay.
        self.graphs = GraphStages(bundle, backend.name, settings, load)
        self.lm = SpeechTokenLM(bundle, backend, load("llm_prefill"), load("llm_decode"))
        # with the dynamic llm_decode too where it takes several positions: a voice's LLM prefix
        decode = self.lm.decode_session if self.lm.takes_prefix else None
        self.lm.fixed_size_decode = self.graphs.fixed_size_decode(self.lm.prefill_session, decode)
        # With flow batching the flow and the vocoder run their graphs through the stage batchers.
        pinned = settings.vocoder_sessions or (3 if backend.name == "ort-cuda" else 1)
        stages = {stage: load(stage) if stage == "flow_estimator" or pinned == 1 else
                  ShapePinnedSession(functools.partial(load, stage), pinned)
                  for stage in ("flow_estimator", "hift_source", "hift_decoder")}
        batchers = start_stage_batching(bundle, backend.name, stages, settings.flow_batching)
        self.stage_batchers = list(batchers.values())
        stages.update(batchers)
        self.static_flow = self.graphs.static_flow()
        batched = self.graphs.batched_flow()  # before the encoder: its slots follow the lanes
        self.static_encoder = self.graphs.static_encoder(encoder_spec(bundle))
        encoders = self.graphs.batched_encoder(encoder_spec(bundle)) or self.static_encoder  # after: its fallback
        self.flow = FlowDecoder(bundle, load("flow_encoder"), stages["flow_estimator"],
                                batched or (self.static_flow if self.static_flow is not None else backend.flow_cache),
                                encoders if encoders is not None else host_encoder_cache, self.graphs.flow_seats,
                                self.graphs.flow_gather)
        self.static_vocoder = self.graphs.static_vocoder()
        pad_final = settings.vocoder_pad_final if settings.vocoder_pad_final is not None else backend.name == "ort-cuda"
        self.vocoder = HiftVocoder(bundle, stages["hift_source"], stages["hift_decoder"], self.static_vocoder,
                                   pad_final)
        self._pinned_vocoder = pinned > 1
        self.warm_vocoder()
        self.tokenizer = TextTokenizer.from_file(bundle.file("tokenizer"))
        self.frontend = TextFrontend(self.tokenizer, max_text_chars=settings.max_text_chars)
        self.conditioning = ConditioningBuilder(bundle, self.tokenizer, self.frontend)
        # Per engine, so a bundle reload (a new engine) starts without the old prefixes.
        self.voice_cache = VoiceCache(settings.voice_cache_mb * MIB, bundle_identity(
            str(bundle.root), json.dumps(bundle.manifest, sort_keys=True), str(bundle.precision)))
        if settings.voice_cache_mb > 0 and not self.lm.takes_prefix:
            log.info("LLM prefix cache off: %s; saved voices cache their flow prefix only", "TensorRT engines run "
                     "single decode steps" if bundle.backend == "trt" else "this bundle's llm_decode takes one new "
                     "position (re-export it with 'cosyedge build export' to cache sos + transcript of saved voices)")
        # The LLM batch on the fixed-shape step (iteration-level scheduler), else on the dynamic graphs.
        self.batcher: LlmBatcher | GraphBatcher | None = None
        if settings.graph_batching:
            fused = self.graphs.fused_step(self.lm.prefill_session, decode) if settings.batching else None
            self.batcher = start_graph_batcher(self.lm, settings.batching, settings.llm_prefills_between_steps,
                                               fused, self.graphs.threads.get("decode"),
                                               GraphPriority[settings.llm_first_chunk_priority.upper()],
                                               settings.llm_parallel_prefills, settings.llm_batched_prefill)
        if self.batcher is None:
            self.batcher = start_batcher(bundle, backend.name, self.lm, settings.batching)
        # Offline requests as streams joined: the streams' batched replays then serve them too.
        self.offline_as_stream = (settings.offline_as_stream if settings.offline_as_stream is not None
                                  else self.graphs.flow_batch is not None)
        self.overlap = resolve_overlap(settings.overlap_stages, backend.name, os.cpu_count())
        self._producers = ProducerPool(settings.producer_threads).start() if self.overlap else None

    def concurrent_streams(self) -> int | None:
        """The GPU flow's stream seats (models/batching/seats.py), where the batched lanes load."""
        seats = self.graphs.flow_seats
        return seats.count if seats is not None else None

    def _load(self, stage: str) -> Session:
        session = self.backend.load(stage, self.bundle.stages[stage].path, threads=self.settings.threads)
        self._sessions.append(session)
        return session

    # --- Synthesizer protocol ---------------------------------------------------------------
    def voices(self) -> list[str]:
        return sorted(self.bundle.voices)

    def modes(self) -> tuple[Mode, ...]:
        return MODES

    def validate(self, request: SynthesisRequest) -> None:
        if request.mode not in MODES:
            raise RequestError("unknown_mode", f"mode {request.mode!r} is not one of {', '.join(MODES)}")
        if not SPEED_MIN <= request.speed <= SPEED_MAX:
            raise RequestError("bad_speed", f"speed must be between {SPEED_MIN} and {SPEED_MAX}, got {request.speed}")
        if request.speed != 1.0 and request.stream:
            raise RequestError("bad_speed", "speed other than 1.0 is only supported with stream=false (as upstream)")
        self.frontend.check(request.text)
        self.conditioning.check(request)

    def synthesize(self, request: SynthesisRequest, cancel: threading.Event | None = None) -> Iterator[AudioChunk]:
        return self._synthesize(request, cancel, validate=True)

    def for_job(self, job_id: str, deadline_at: float | None, *, validated: bool = False) -> SynthesizeFn:
        if not validated:
            return self.synthesize
        return lambda request, cancel=None: self._synthesize(request, cancel, validate=False)

    def _synthesize(self, request: SynthesisRequest, cancel: threading.Event | None, *,
                    validate: bool) -> Iterator[AudioChunk]:
        started = time.perf_counter()
        if validate:
            self.validate(request)
        seed = request.seed if request.seed is not None else int(np.random.default_rng().integers(1 << 62))
        sampler_seq, noise_seq = np.random.SeedSequence(seed).spawn(2)
        state = RequestState(
            sampler=TokenSampler(self.bundle.llm.sampling, self.bundle.llm.eos_token,
                                 np.random.default_rng(sampler_seq)),
            noise=self.noise_factory(noise_seq),
            times=StageTimes(),
            started=started,
            cancel=cancel,
            priority=request.priority,
            first_audio=request.stream,
        )
        as_stream = request.stream or (self.offline_as_stream and request.speed == 1.0)
        t0 = time.perf_counter()
        cond = self.conditioning.build(request)
        segments = self.frontend.prepare(request.text)
        state.times.frontend_ms += (time.perf_counter() - t0) * 1e3
        llm_prefix = self.llm_prefix(cond, request.mode)
        for i, segment in enumerate(segments):
            last_segment = i == len(segments) - 1
            llm_in = LlmInput(text=segment.token_ids.tolist(), prompt_text=cond.prompt_text,
                              prompt_speech=cond.prompt_speech, prefix=llm_prefix)
            pieces = self._stream_segment(llm_in, cond, state) if as_stream else self._offline_segment(
                llm_in, cond, state, request.speed)
            if as_stream and not request.stream:
                pieces = joined(pieces)
            # closing(): when the caller stops early (break, gen.close()) or a stage
            # raises, the segment's producer is stopped here, not at garbage collection.
            with contextlib.closing(pieces):
                for pcm, final in pieces:
                    if state.cancelled():
                        return
                    yield self._chunk(state, pcm, last=final and last_segment)

    def voice_prefix(self, cond: Conditioning) -> FlowPrefix | None:
        return saved_voice_prefix(self.voice_cache, self.flow, cond, self.settings.voice_cache_mb > 0,
                                  self.settings.flow_left_chunks)

    def llm_prefix(self, cond: Conditioning, mode: Mode) -> LlmPrefix | None:
        return saved_voice_llm_prefix(self.voice_cache, self.lm, cond, mode, self.settings.voice_cache_mb > 0)

    def warm_voice(self, request: SynthesisRequest) -> FlowPrefix | None:
        """Build the prompt caches of the request's saved voice now (startup,
        benchmarks): the flow prefix (returned) and, in zero_shot, the LLM prefix."""
        self.validate(request)
        cond = self.conditioning.build(request)
        self.llm_prefix(cond, request.mode)
        return self.voice_prefix(cond)

    def prepare_voice(self, name: str) -> int:
        """The saved voice `name` ready for its first requests (the daemon's default voice at start, bench
        --voice): its prompt caches (warm_voice; zero_shot, else cross_lingual) and its flow prefix in every free
        batched lane (estimator and encoder). The estimator lanes seeded; 0 for a voice without a recording."""
        for mode in ("zero_shot", "cross_lingual"):
            request = SynthesisRequest(text="voice", mode=mode, voice=name)
            try:
                self.validate(request)
            except RequestError as exc:
                if exc.code == "voice_unsuitable":
                    continue
                raise
            prefix = self.warm_voice(request)
            batcher = self.graphs.flow_batch
            if prefix is None or batcher is None:
                return 0
            if self.graphs.encoder_batch is not None:
                self.graphs.encoder_batch.seed_free(prefix.encoder)
            return batcher.lanes.seed_free_lanes(prefix.step_kv, prefix.step_conv)
        return 0

    def warm_vocoder(self) -> list[int]:
        """Set up the dynamic vocoder at the settings' recurring chunk lengths no fixed-length graph serves
        (on the CUDA provider a convolution's first call at a new shape costs 150-200 ms, which the first
        request would pay). At load, and by bench after it changes the first hop; the lengths set up."""
        if not self._pinned_vocoder:
            return []
        b, s = self.bundle, self.settings
        fixed = set(self.static_vocoder.frames) if self.static_vocoder is not None else set()
        lengths = [n for n in stream_mel_frames(b.streaming.token_hop_len, b.token_mel_ratio, b.streaming.mel_cache_len,
                                                s.first_hop_tokens, s.hop_scale, s.max_hop_tokens) if n not in fixed]
        self.vocoder.warm_up(lengths)
        return lengths

    def session_memory_bytes(self) -> int:
        """What the stage sessions hold (Session.memory_bytes, best effort), for benchmarks."""
        return sum(s.memory_bytes() for s in self._sessions)

    def set_load_level(self, level: LoadLevel) -> None:
        """The daemon's load hint: under load ("degraded") requests join the LLM batch without delay."""
        delay = 0.0 if level == "degraded" else None
        if self.batcher is not None:
            self.batcher.delay_ms = delay
        for stage in self.stage_batchers:
            stage.delay_ms = delay

    @contextlib.contextmanager
    def request_group(self, size: int, timeout_s: float) -> Iterator[RequestGroup | None]:
        """`size` requests about to be synthesized on other threads start their
        LLM decode together (models/batching/group.py); None without batching."""
        if self.batcher is None:
            yield None
            return
        with self.batcher.group(size, timeout_s) as group:
            yield group

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.stop()
        for stage in self.stage_batchers:
            stage.stop()
        if self._producers is not None:
            self._producers.stop()  # before the sessions it runs are closed
        self.graphs.close()  # after their users, before the sessions the graph thread ran
        for s in self._sessions:
            s.close()
        self._sessions.clear()
        self.conditioning.close()
        self.voice_cache.clear()

    # --- internals ---------------------------------------------------------------------
    def _chunk(self, state: RequestState, pcm: np.ndarray, last: bool) -> AudioChunk:
        times = state.times
        times.llm_ms = state.llm.prefill_ms + state.llm.decode_ms
        times.llm_tokens = state.tokens_before + len(state.llm.tokens)
        times.llm_batch_max = state.llm.batch_max
        if times.first_audio_ms is None and pcm.size:
            times.first_audio_ms = (time.perf_counter() - state.started) * 1e3
        state.audio_sent_s += pcm.size / self.sample_rate
        chunk = AudioChunk(pcm=pcm.astype(np.float32, copy=False), sample_rate=self.sample_rate,
                           index=state.index, last=last, times=times)
        state.index += 1
        return chunk

    def _token_source(self, llm_in: LlmInput, state: RequestState, first_tokens: int = 0,
                      overlap: bool = True) -> TokenSource:
        """The segment's tokens: a batched request's from the batcher's worker, handed over a chunk's
        worth at a time; else from a producer thread when stages overlap. `first_tokens`: before first audio."""
        # The token list is per segment (upstream's repetition window); the count is per request.
        state.tokens_before += len(state.llm.tokens)
        state.llm.tokens.clear()
        tokens = (self.batcher.open(llm_in, state.sampler, state.llm, priority=state.priority, cancel=state.cancel,
                                    first_tokens=first_tokens) if self.batcher is not None
                  else self.lm.generate(llm_in, state.sampler, state.llm))
        if isinstance(tokens, TokenStream):
            return tokens.timed()
        if self._producers is None or not overlap:
            return SerialTokens(tokens)
        return self._producers.submit(ProducedTokens(tokens, state.cancelled, self.settings.overlap_queue_tokens))

    def _flow(self, tokens: list[int], cond: Conditioning, state: RequestState, finalize: bool,
              streaming: bool) -> np.ndarray:
        t0 = time.perf_counter()
        work = EstimatorWork()
        with call_priority(state.priority):
            mel = self.flow.mel(np.asarray(tokens, dtype=np.int64), cond.flow, finalize=finalize,
                                streaming=streaming, work=work)
        t1 = time.perf_counter()
        state.times.flow_ms += (t1 - t0) * 1e3
        state.times.flow_frames += work.frames
        state.event("flow", t0, t1)
        return mel

    def _flow_stream(self, flow: FlowStream, tokens: list[int], state: RequestState, final: bool,
                     prime: bool = False) -> np.ndarray:
        t0 = time.perf_counter()
        before = flow.work.frames
        array = np.asarray(tokens, dtype=np.int64)
        with call_priority(state.priority):
            mel = flow.prime() if prime else flow.finish(array) if final else flow.push(array)
        t1 = time.perf_counter()
        state.times.flow_ms += (t1 - t0) * 1e3
        state.times.flow_frames += flow.work.frames - before
        state.event("flow", t0, t1)
        return mel

    def _offline_segment(self, llm_in: LlmInput, cond: Conditioning, state: RequestState,
                         speed: float) -> Generator[tuple[np.ndarray, bool], None, None]:
        tokens = []
        spans = LlmSpans()
        with self._token_source(llm_in, state, overlap=False) as source:
            source.want(sys.maxsize)  # flow needs every token first
            for timed in source:
                tokens.append(timed.token)
                spans.add(state, timed)
                if state.cancelled():
                    return
            spans.finish(state, source.end)
        if not tokens:
            yield np.zeros(0, dtype=np.float32), True
            return
        mel = self._flow(tokens, cond, state, finalize=True, streaming=False)
        if speed != 1.0:
            mel = linear_resize(mel, int(mel.shape[2] / speed))
        t0 = time.perf_counter()
        with call_priority(state.priority):
            audio, _ = self.vocoder.run(mel, state.noise)
        t1 = time.perf_counter()
        state.times.vocoder_ms += (t1 - t0) * 1e3
        state.event("vocoder", t0, t1)
        yield audio[0], True

    def _stream_segment(self, llm_in: LlmInput, cond: Conditioning,
                        state: RequestState) -> Generator[tuple[np.ndarray, bool], None, None]:
        # Per request: the estimator caches, so each chunk costs only its new frames
        # (device memory with a GPU backend): released when the segment ends, fails
        # or is abandoned (synthesize closes this generator).
        prefix = self.voice_prefix(cond)
        with self.flow.stream(cond.flow, self.settings.flow_final_chunk, self.settings.flow_left_chunks,
                              prefix, self.settings.first_chunk_euler_steps) as flow:
            # A saved voice without its cache computes the same prefix itself: identical output.
            prime = prefix is None and cond.voice is not None and flow.cached and self.settings.flow_left_chunks < 0
            yield from self._stream_chunks(flow, llm_in, cond, state, prime)

    def _stream_chunks(self, flow: FlowStream, llm_in: LlmInput, cond: Conditioning,
                       state: RequestState, prime: bool = False) -> Generator[tuple[np.ndarray, bool], None, None]:
        lookahead = self.bundle.flow.pre_lookahead_len
        schedule = ChunkSchedule(self.bundle.streaming.token_hop_len, lookahead,
                                 prompt_tokens=len(cond.flow.tokens), first_hop=self.settings.first_hop_tokens,
                                 hop_scale=self.settings.hop_scale, max_hop=self.settings.max_hop_tokens,
                                 grown_start=not state.first_audio)  # offline: no first audio to hurry
        stream = VocoderStream(self.vocoder, state.noise)
        tokens: list[int] = []
        spans = LlmSpans()
        # With overlap the LLM keeps decoding on its producer thread while this
        # generator runs flow + vocoder below and waits at the yield.
        first_tokens = schedule.first_chunk_tokens() if state.index == 0 and state.first_audio else 0
        with self._token_source(llm_in, state, first_tokens) as source:
            if prime:  # while the LLM producer (if stages overlap) decodes
                self._flow_stream(flow, [], state, final=False, prime=True)
            source.want(schedule.next_chunk_tokens())
            for timed in source:
                tokens.append(timed.token)
                spans.add(state, timed)
                while (chunk := schedule.next_chunk(len(tokens))) is not None:
                    spans.take(state, timed.end)
                    source.want(schedule.next_chunk_tokens())
                    flow.hold_s = self.graphs.gather_budget_s(state)  # a later chunk: graph_flow_gather_ms
                    with self._first_chunk(state):
                        # the frames of tokens [chunk.start, chunk.end): what upstream's full-prefix
                        # pass over tokens[:chunk.end + lookahead] gives for them
                        mel = self._flow_stream(flow, tokens[:chunk.end + lookahead], state, final=False)
                        pcm = self._vocode(stream, mel, state, final=False)
                    yield pcm, False
                if state.cancelled():
                    return
            if state.cancelled():
                return
            spans.finish(state, source.end)
        schedule.final_chunk(len(tokens))
        with self._first_chunk(state):
            if tokens:
                mel = self._flow_stream(flow, tokens, state, final=True)
            else:
                mel = np.zeros((1, self.bundle.mel_bins, 0), dtype=np.float32)
            empty = mel.shape[2] == 0 and stream.mel is None
            last = np.zeros(0, dtype=np.float32) if empty else self._vocode(stream, mel, state, final=True)
        yield last, True

    @contextlib.contextmanager
    def _first_chunk(self, state: RequestState) -> Iterator[None]:
        """Around a chunk's flow and vocoder: until the request's first audio is out, a
        first-audio hold on the graph thread(s) (GraphStages.first_audio), timed as "hold"."""
        if state.times.first_audio_ms is not None or not state.first_audio or not self.graphs.holds_first_audio:
            yield
            return
        t0 = time.perf_counter()
        try:
            with self.graphs.first_audio(self.batcher.active if self.batcher is not None else None):
                yield
        finally:
            state.event("hold", t0, time.perf_counter())

    def _vocode(self, stream: VocoderStream, mel: np.ndarray, state: RequestState, final: bool) -> np.ndarray:
        t0 = time.perf_counter()
        with call_priority(state.priority):
            pcm = stream.push(mel, final=final)
        t1 = time.perf_counter()
        state.times.vocoder_ms += (t1 - t0) * 1e3
        state.event("vocoder", t0, t1)
        return pcm


def load_synthesizer(bundle_dir: Path | str, backend: str | None = None,
                settings: SynthesisSettings | None = None) -> CosyVoiceSynthesizer:
    """Load a bundle and its sessions on `settings.backend` (or `backend`
    without settings); raises BundleError with what to do."""
    if settings is None:
        settings = SynthesisSettings(backend=backend or "ort")
    elif backend is not None and backend != settings.backend:
        raise ValueError(f"backend {backend!r} differs from settings.backend {settings.backend!r}")
    name = settings.backend
    # The trt backend loads the bundle's TensorRT plans, checked against this GPU.
    precision = settings.precision
    if precision is None and name in AUTO_BACKENDS:  # fp16 on CUDA where the bundle measured it faster
        precision = auto_precision(bundle_dir, name, load_bundle(bundle_dir).manifest)
    bundle = load_bundle(bundle_dir, precision=precision, backend="trt" if name == "trt" else "ort")
    backend_ = create_backend(name, cpu_memory_arena=settings.cpu_memory_arena, bundle=bundle)
    return CosyVoiceSynthesizer(bundle, backend_, settings)
