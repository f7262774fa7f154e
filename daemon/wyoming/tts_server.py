"""The Wyoming TTS server's protocol: describe → info; synthesize → one
request; synthesize-start / -chunk / -stop → one request per sentence as
each completes (streaming.py), the legacy synthesize a streaming client also
sends ignored; ping → pong; unknown events ignored. Every request is built by
the one builder and admitted through serving's Admission (scheduler, router,
metrics, trace);
its answers come back through the ChannelResponder."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from cosyedge_daemon.request.builder import build_request
from cosyedge_daemon.request.errors import ApiError
from cosyedge_daemon.serving.admission import Admission
from cosyedge_daemon.serving.channels import Audio, Budget, Channel, ChannelResponder, Done, Failed
from cosyedge_daemon.serving.jobs import Job
from cosyedge_daemon.wyoming.framing import write_event
from cosyedge_daemon.wyoming.streaming import SentenceBuffer
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Describe, Info
from wyoming.ping import Ping, Pong
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped, SynthesizeVoice

log = logging.getLogger(__name__)

WIDTH, CHANNELS = 2, 1  # PCM16 mono, as the MQTT audio
_LOOKAHEAD = 1  # sentences admitted ahead of the one being sent (so the next one is queued in time)
_END = None


@dataclass
class TtsContext:
    """What every TTS connection shares (built once by the front end)."""

    admission: Admission
    responder: ChannelResponder
    info: Callable[[], Info]
    voice_for: Callable[[SynthesizeVoice | None], str | None]
    priority: int
    max_buffered_bytes: Callable[[int], int]  # for a sample rate


class _Run:
    """The requests of one synthesize (one sentence list) or one streaming session."""

    def __init__(self, streaming: bool, voice: str | None) -> None:
        self.streaming = streaming
        self.voice = voice
        self.sentences: asyncio.Queue[tuple[str, float] | None] = asyncio.Queue()
        self.buffer: SentenceBuffer | None = None
        self.task: asyncio.Task[None] | None = None


class TtsHandler:
    def __init__(self, ctx: TtsContext, writer: asyncio.StreamWriter) -> None:
        self.ctx = ctx
        self.writer = writer
        self.loop = asyncio.get_running_loop()
        self.budget = Budget(ctx.max_buffered_bytes(24000))
        self.jobs: dict[str, Job] = {}  # admitted and not yet answered
        self.runs: list[_Run] = []
        self.stream: _Run | None = None  # the open streaming session
        self._tail: asyncio.Task[None] | None = None  # the run launched last: the next one answers after it

    # --- events in ---------------------------------------------------------------------
    async def handle(self, event: Event) -> bool:
        now = time.monotonic()
        if self.budget.overrun:
            await self._error("too_slow", "the client does not read its audio; closing")
            return False
        if Describe.is_type(event.type):
            await write_event(self.ctx.info().event(), self.writer)
        elif Ping.is_type(event.type):
            await write_event(Pong(text=event.data.get("text")).event(), self.writer)
        elif SynthesizeStart.is_type(event.type):
            await self._start_stream(SynthesizeStart.from_event(event).voice)
        elif SynthesizeChunk.is_type(event.type):
            await self._stream_chunk(event, now)
        elif SynthesizeStop.is_type(event.type):
            await self._stop_stream(now)
        elif Synthesize.is_type(event.type):
            await self._synthesize(event, now)
        else:
            log.debug("Wyoming TTS: ignoring event %r", event.type)
        return True

    async def _synthesize(self, event: Event, now: float) -> None:
        if self.stream is not None:
            return  # the legacy event a streaming client sends too: ignored, as the protocol asks
        text = event.data.get("text")
        if not isinstance(text, str) or not text.strip():
            await self._error("invalid_field", "'synthesize' needs a non-empty 'text' string")
            return
        voice = self._voice(event.data.get("voice"))
        run = _Run(False, voice)
        run.sentences.put_nowait((text, now))
        run.sentences.put_nowait(_END)
        self._launch(run)

    async def _start_stream(self, voice: SynthesizeVoice | None) -> None:
        if self.stream is not None:
            await self._error("invalid_state", "synthesize-start while a stream is open; ending the old one")
            self.stream.sentences.put_nowait(_END)
        run = _Run(True, self.ctx.voice_for(voice))
        run.buffer = SentenceBuffer(self.ctx.admission.limits.max_text_chars)
        self.stream = run
        self._launch(run)

    async def _stream_chunk(self, event: Event, now: float) -> None:
        run = self.stream
        text = event.data.get("text")
        if run is None or run.buffer is None:
            await self._error("invalid_state", "synthesize-chunk without synthesize-start (ignored)")
            return
        if not isinstance(text, str):
            await self._error("invalid_field", "'synthesize-chunk' needs a 'text' string")
            return
        try:
            for sentence in run.buffer.add(text):
                run.sentences.put_nowait((sentence, now))
        except ValueError as exc:
            await self._error("text_too_long", str(exc))

    async def _stop_stream(self, now: float) -> None:
        run, self.stream = self.stream, None
        if run is None or run.buffer is None:
            await self._error("invalid_state", "synthesize-stop without synthesize-start")
            return
        for sentence in run.buffer.finish():
            run.sentences.put_nowait((sentence, now))
        run.sentences.put_nowait(_END)

    def _voice(self, raw: object) -> str | None:
        return self.ctx.voice_for(SynthesizeVoice.from_dict(raw) if isinstance(raw, dict) else None)

    # --- requests and audio out ---------------------------------------------------------------
    def _launch(self, run: _Run) -> None:
        self.runs.append(run)
        run.task = asyncio.create_task(self._forward(run, self._tail), name="wyoming-tts-run")
        self._tail = run.task

    async def _forward(self, run: _Run, previous: asyncio.Task[None] | None) -> None:
        """Admit the run's sentences (one ahead) and send their audio in order, after the
        connection's previous run has sent all of its own: one connection is one event
        stream, so two answers must never interleave (nor overtake each other)."""
        if previous is not None:
            await asyncio.wait([previous])
        admitted: asyncio.Queue[tuple[Job, Channel] | None] = asyncio.Queue(maxsize=_LOOKAHEAD)
        admitter = asyncio.create_task(self._admit_all(run, admitted))
        failed = False
        try:
            while (item := await admitted.get()) is not None:
                job, channel = item
                if failed:
                    self._cancel(job)
                    continue
                failed = not await self._send_job(job, channel)
            if run.streaming and not failed:
                await write_event(SynthesizeStopped().event(), self.writer)
        except (ConnectionError, OSError):
            pass
        finally:
            admitter.cancel()
            if self.runs and run in self.runs:
                self.runs.remove(run)

    async def _admit_all(self, run: _Run, out: asyncio.Queue[tuple[Job, Channel] | None]) -> None:
        try:
            while (item := await run.sentences.get()) is not None:
                text, received_at = item
                admitted = await self._admit(text, received_at, run.voice)
                if admitted is None:
                    break
                await out.put(admitted)
        finally:
            await out.put(None)

    async def _admit(self, text: str, received_at: float, voice: str | None) -> tuple[Job, Channel] | None:
        try:
            request = build_request(self.ctx.admission.limits, text, id_prefix="wyoming-", voice=voice,
                                    output="publish", priority=self.ctx.priority, received_at=received_at)
        except ApiError as exc:
            await self._error(exc.code, exc.message)
            return None
        channel = Channel(self.loop, self.budget)
        self.ctx.responder.attach(request.id, channel)
        # On the loop, not a helper thread: validation is short (a tokenizer pass) and one thread
        # hop less is measurably sooner first audio on a busy two-core board.
        job = self.ctx.admission.admit(request, self.ctx.responder)
        if job is None:  # refused: its one answer, the error, is on the channel
            answer = await channel.queue.get()
            self.ctx.responder.detach(request.id)
            if isinstance(answer, Failed):
                await self._error(answer.code, answer.message)
            return None
        self.jobs[job.id] = job
        return job, channel

    async def _send_job(self, job: Job, channel: Channel) -> bool:
        """One request's audio-start, audio-chunks, audio-stop; False after an error."""
        started = False
        try:
            while True:
                item = await channel.queue.get()
                if isinstance(item, Audio):
                    if not started:
                        await write_event(AudioStart(item.sample_rate, WIDTH, CHANNELS).event(), self.writer)
                        started = True
                    await write_event(AudioChunk(item.sample_rate, WIDTH, CHANNELS, item.pcm16).event(),
                                      self.writer)
                    self.budget.give(len(item.pcm16))
                elif isinstance(item, Done):
                    if not started:  # no audio at all (e.g. only punctuation): still a well-formed stream
                        rate = int(item.summary.get("sample_rate") or 24000)
                        await write_event(AudioStart(rate, WIDTH, CHANNELS).event(), self.writer)
                    await write_event(AudioStop().event(), self.writer)
                    return True
                elif isinstance(item, Failed):
                    if started:
                        await write_event(AudioStop().event(), self.writer)
                    await self._error(item.code, item.message)
                    return False
        finally:  # answered, or the connection failed while sending (then cancel it here: nobody else will)
            self._cancel(job)

    # --- the end --------------------------------------------------------------------------
    async def closed(self) -> None:
        """Disconnect (or server stop): cancel every request of this connection."""
        for run in list(self.runs):
            if run.task is not None:
                run.task.cancel()
        for job in list(self.jobs.values()):
            self._cancel(job)

    def _cancel(self, job: Job) -> None:
        if not job.finished:
            log.info("Wyoming client gone: cancelling %s", job.id)
            self.ctx.admission.cancel(job.id)
        self._forget(job)

    def _forget(self, job: Job) -> None:
        self.jobs.pop(job.id, None)
        self.ctx.responder.detach(job.id)

    async def _error(self, code: str, text: str) -> None:
        log.info("Wyoming TTS error %s: %s", code, text)
        await write_event(Error(text=text, code=code).event(), self.writer)

