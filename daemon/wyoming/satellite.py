"""The board as a Wyoming satellite. Home Assistant connects (one connection
at a time; a new one replaces the old), asks `describe`, sends
`run-satellite`; from then on each utterance the daemon's WebRTC VAD finds
is streamed to its pipeline: `run-pipeline` (start stage asr, or wake for a
server-side wake word), `audio-start`, the pre-roll and the live 16 kHz
frames as `audio-chunk`s, `audio-stop` at speech_end (or when Home Assistant
says `transcript` / `voice-stopped` / `error`). Its TTS audio (`audio-start`
/ `-chunk` / `-stop`) plays through the daemon's playback (relay.py) and is
answered with `played`. `pause-satellite` stops streaming; `ping` → `pong`.

Thread model: `on_frame` / `on_vad_event` run on the VAD worker's thread
(the VadWorker tap) and only queue events for the connection's loop."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time

from cosyedge_daemon.api.vad_topics import VoiceLink
from cosyedge_daemon.audio.interfaces import VadEvent
from cosyedge_daemon.serving.jobs import Job
from cosyedge_daemon.serving.pipeline import Pipeline
from cosyedge_daemon.settings.audio import VAD_SAMPLE_RATE, VadSettings
from cosyedge_daemon.settings.wyoming import SatelliteSettings
from cosyedge_daemon.wyoming.framing import write_event
from cosyedge_daemon.wyoming.relay import PlaybackRelay, PlayedResponder, wyoming_pcm
from wyoming.asr import Transcript
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Attribution, Describe, Info
from wyoming.info import Satellite as SatelliteInfo
from wyoming.ping import Ping, Pong
from wyoming.pipeline import PipelineStage, RunPipeline
from wyoming.satellite import PauseSatellite, RunSatellite
from wyoming.snd import Played
from wyoming.tts import Synthesize
from wyoming.vad import VoiceStopped

log = logging.getLogger(__name__)

MIC_WIDTH, MIC_CHANNELS = 2, 1
_OUTBOX_MAX = 2000  # events not yet written (about a minute of 30 ms frames)
_ENDS_STREAM = (Transcript.is_type, VoiceStopped.is_type, Error.is_type)


class SatelliteHandler:
    """One Home Assistant connection."""

    def __init__(self, owner: Satellite, writer: asyncio.StreamWriter) -> None:
        self.owner = owner
        self.writer = writer
        self.outbox: asyncio.Queue[Event] = asyncio.Queue()
        self.running = False  # run-satellite received, not paused
        self.playing: Job | None = None  # the TTS audio being relayed
        self.play_format: tuple[int, int, int] = (22050, 2, 1)
        self.loop = asyncio.get_running_loop()
        self._writer_task = asyncio.create_task(self._write_loop())
        owner.replace_handler(self)

    async def _write_loop(self) -> None:
        while True:
            event = await self.outbox.get()
            try:
                await write_event(event, self.writer)
            except (ConnectionError, OSError):
                return

    def send(self, event: Event) -> None:  # the loop's thread
        if self.outbox.qsize() < _OUTBOX_MAX:
            self.outbox.put_nowait(event)

    async def handle(self, event: Event) -> bool:
        t = event.type
        if Describe.is_type(t):
            self.send(self.owner.info().event())
        elif Ping.is_type(t):
            self.send(Pong(text=event.data.get("text")).event())
        elif RunSatellite.is_type(t):
            self.running = True
            log.info("satellite: Home Assistant runs the satellite")
        elif PauseSatellite.is_type(t):
            self.running = False
            self.owner.end_stream(self, "paused")
        elif AudioStart.is_type(t):
            await self._play_start(AudioStart.from_event(event))
        elif AudioChunk.is_type(t):
            await self._play_chunk(AudioChunk.from_event(event))
        elif AudioStop.is_type(t):
            self._play_stop()
        elif any(check(t) for check in _ENDS_STREAM):
            log.info("satellite: %s %s", t, event.data)
            self.owner.end_stream(self, t)
        elif Synthesize.is_type(t):
            log.info("satellite: Home Assistant answers %r", event.data.get("text"))
        else:
            log.debug("satellite: %s %s", t, event.data)  # detection, voice-started, run-pipeline, ...
        return True

    # --- Home Assistant's TTS audio → the daemon's playback -------------------------------
    async def _play_start(self, start: AudioStart) -> None:
        if self.playing is not None:
            self._play_stop()
        self.play_format = (start.rate, start.width, start.channels)
        self.playing = self.owner.relay.open(PlayedResponder(self._played))

    async def _play_chunk(self, chunk: AudioChunk) -> None:
        job = self.playing
        if job is None:
            return  # audio without audio-start: nothing to play it into
        try:
            pcm = wyoming_pcm(chunk.audio, chunk.width, chunk.channels)
        except ValueError as exc:
            self.send(Error(text=str(exc), code="unsupported_audio").event())
            return
        await self.loop.run_in_executor(None, self.owner.relay.put, job, pcm, chunk.rate)

    def _play_stop(self) -> None:
        job, self.playing = self.playing, None
        if job is not None:
            self.owner.relay.end(job)

    def _played(self, job: Job) -> None:  # any thread: the playback worker, or ours
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.send, Played().event())

    async def closed(self) -> None:
        self.running = False
        self.owner.end_stream(self, "disconnected")
        self.owner.forget_handler(self)
        job, self.playing = self.playing, None
        if job is not None:
            self.owner.pipeline.stop_job(job, "cancelled")
            self.owner.relay.end(job)
        self._writer_task.cancel()


class Satellite:
    def __init__(self, settings: SatelliteSettings, vad: VadSettings, pipeline: Pipeline, voice: VoiceLink,
                 device_id: str, version: str) -> None:
        self.settings = settings
        self.pipeline = pipeline
        self.voice = voice
        self.relay = PlaybackRelay(pipeline)
        self.name = settings.name or device_id
        self.version = version
        self.pre_roll_s = vad.pre_roll_ms / 1000.0
        keep_s = (vad.pre_roll_ms + vad.start_window_ms + vad.min_utterance_ms) / 1000.0 + 1.0
        self._ring: collections.deque[tuple[float, bytes]] = collections.deque(
            maxlen=int(keep_s * 1000 / vad.frame_ms) + 1)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.current: SatelliteHandler | None = None
        self._streaming_to: SatelliteHandler | None = None  # VAD thread's view
        self._stream_started = 0.0
        self.utterances = 0

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def handler(self, writer: asyncio.StreamWriter) -> SatelliteHandler:
        return SatelliteHandler(self, writer)

    def replace_handler(self, handler: SatelliteHandler) -> None:
        if self.current is not None and self.current is not handler:
            log.info("satellite: a new Home Assistant connection replaces the old one")
            self.current.writer.close()
        self.current = handler

    def forget_handler(self, handler: SatelliteHandler) -> None:
        if self.current is handler:
            self.current = None

    def info(self) -> Info:
        attribution = Attribution(name="cosyedge", url="https://github.com/FunAudioLLM/CosyVoice")
        return Info(satellite=SatelliteInfo(
            name=self.name, attribution=attribution, installed=True, version=self.version,
            description="cosyedge satellite (WebRTC VAD, CosyVoice speaker)",
            area=self.settings.area or None, has_vad=True, supports_trigger=False,
        ))

    # --- the VAD worker's thread ------------------------------------------------------------
    def _post(self, handler: SatelliteHandler, *events: Event) -> None:
        if self.loop is None:
            return
        for event in events:
            try:
                self.loop.call_soon_threadsafe(handler.send, event)
            except RuntimeError:  # the loop is closed
                return

    def on_vad_event(self, event: VadEvent) -> None:
        if event.kind == "speech_start":
            handler = self.current
            if handler is None or not handler.running or self._streaming_to is not None:
                return
            self.utterances += 1
            stage = PipelineStage.ASR if self.settings.start_stage == "asr" else PipelineStage.WAKE
            self._streaming_to, self._stream_started = handler, time.monotonic()
            start = event.time_s - self.pre_roll_s
            self._post(handler, RunPipeline(start_stage=stage, end_stage=PipelineStage.TTS).event(),
                       AudioStart(VAD_SAMPLE_RATE, MIC_WIDTH, MIC_CHANNELS, timestamp=0).event())
            for t, frame in list(self._ring):
                if t >= start - 1e-6:
                    self._post(handler, self._chunk(frame, t))
        elif self._streaming_to is not None:
            self._stop_stream()

    def on_frame(self, frame: bytes, t: float) -> None:
        self._ring.append((t, frame))
        handler = self._streaming_to
        if handler is None:
            return
        if handler is not self.current or time.monotonic() - self._stream_started > self.settings.max_utterance_s:
            self._stop_stream()
            return
        self._post(handler, self._chunk(frame, t))

    def _chunk(self, frame: bytes, t: float) -> Event:
        return AudioChunk(VAD_SAMPLE_RATE, MIC_WIDTH, MIC_CHANNELS, frame, timestamp=int(t * 1000)).event()

    def _stop_stream(self) -> None:
        handler, self._streaming_to = self._streaming_to, None
        if handler is not None:
            self._post(handler, AudioStop().event())

    # --- any thread: Home Assistant ended the stream ---------------------------------------
    def end_stream(self, handler: SatelliteHandler, why: str) -> None:
        if self._streaming_to is handler:
            log.info("satellite: streaming ends (%s)", why)
            self._stop_stream()
