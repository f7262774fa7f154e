"""The board as a Wyoming satellite, with a test client playing Home
Assistant's part (the `wyoming` package's AsyncTcpClient): recorded human
speech through the daemon's audio-source interface and its VAD worker is
streamed as run-pipeline / audio-start / chunks (with the pre-roll) /
audio-stop; Home Assistant's TTS audio plays through the daemon's playback
and is answered with `played`; speech over it is a barge-in."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from cosyedge_daemon.audio.sources import ArraySource
from cosyedge_daemon.audio.vad_worker import VadWorker
from cosyedge_daemon.service.service import Service
from cosyedge_daemon.settings.audio import VadSettings
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.event import Event
from wyoming.info import Describe, Info
from wyoming.satellite import RunSatellite
from wyoming.tts import Synthesize

from tests.daemon.conftest import DaemonFactory
from tests.support.fake_synthesizer import FakeSynthesizer
from tests.support.memory_sink import MemorySink
from tests.support.speech import Clip, load_clips, mix, require_speech_data
from tests.support.wyoming_client import read_until

SAT = {"uri": "tcp://127.0.0.1:0", "name": "kitchen-board", "area": "Kitchen"}


@pytest.fixture(scope="module")
def clips() -> dict[str, Clip]:
    data = require_speech_data()
    return load_clips(data)


def _port(svc: Service) -> int:
    assert svc.wyoming is not None and svc.wyoming.satellite_listener is not None
    return svc.wyoming.satellite_listener.port


def _mic(svc: Service, pcm16: np.ndarray, vs: VadSettings) -> tuple[VadWorker, ArraySource]:
    """The microphone path of `cosyedge run` (service_main): a VadWorker on an
    AudioSource, events to the VoiceLink (barge-in), the satellite as its tap."""
    source = ArraySource(pcm16, vs.frame_ms, realtime=True)
    worker = VadWorker(source, vs, on_event=svc.voice.on_vad_event)
    svc.speaking_listeners.append(worker.set_speaking)
    assert svc.wyoming is not None and svc.wyoming.satellite is not None
    worker.taps.append(svc.wyoming.satellite)
    return worker, source


async def _read_until(client: AsyncTcpClient, kind: str, timeout_s: float = 30.0) -> list[Event]:
    return await read_until(client, (kind,), timeout_s)


def test_utterance_streamed_to_home_assistant_and_answer_played(daemons: DaemonFactory,
                                                                clips: dict[str, Clip]) -> None:
    vs = VadSettings()
    m = mix([clips["phrase1"]], [0.6], 3.0, "white", 25, seed=1)
    sink = MemorySink(24000)
    svc = daemons.start(sink=sink, local=FakeSynthesizer(), fallback=None,
                        wyoming={"zeroconf": "off", "satellite": SAT})
    worker, _source = _mic(svc, m.pcm16, vs)

    async def home_assistant() -> tuple[list[Event], list[Event]]:
        async with AsyncTcpClient("127.0.0.1", _port(svc)) as ha:
            await ha.write_event(Describe().event())
            info_events = await _read_until(ha, "info")
            await ha.write_event(RunSatellite().event())
            await asyncio.sleep(0.1)
            worker.start()  # the microphone starts hearing the recording
            streamed = await _read_until(ha, "audio-stop")
            # Home Assistant answers: the text, then its TTS audio (1 s at 22.05 kHz)
            await ha.write_event(Synthesize(text="It is sunny.").event())
            await ha.write_event(AudioStart(22050, 2, 1).event())
            tone = (np.sin(np.arange(22050) * 0.05) * 8000).astype("<i2").tobytes()
            for i in range(0, len(tone), 4096):
                await ha.write_event(AudioChunk(22050, 2, 1, tone[i:i + 4096]).event())
            await ha.write_event(AudioStop().event())
            played = await _read_until(ha, "played")
            return info_events + streamed, played

    try:
        got, played = asyncio.run(home_assistant())
    finally:
        worker.stop()
    info = Info.from_event(next(e for e in got if e.type == "info"))
    assert info.satellite is not None and info.satellite.name == "kitchen-board"
    assert info.satellite.area == "Kitchen" and info.satellite.has_vad
    kinds = [e.type for e in got if e.type != "info"]
    assert kinds[:2] == ["run-pipeline", "audio-start"] and kinds[-1] == "audio-stop"
    run_pipeline = next(e for e in got if e.type == "run-pipeline")
    assert (run_pipeline.data["start_stage"], run_pipeline.data["end_stage"]) == ("asr", "tts")
    chunks = [AudioChunk.from_event(e) for e in got if e.type == "audio-chunk"]
    assert {(c.rate, c.width, c.channels) for c in chunks} == {(16000, 2, 1)}
    streamed_s = sum(len(c.audio) for c in chunks) / 2 / 16000
    speech_s = m.truth[0][1] - m.truth[0][0]
    first_ms = chunks[0].timestamp
    assert first_ms is not None and first_ms / 1000 <= m.truth[0][0] - 0.2, "the pre-roll is sent"
    assert speech_s * 0.8 < streamed_s < speech_s + 1.5
    assert played[-1].type == "played"
    assert sink.played_seconds() == pytest.approx(1.0, abs=0.1), "Home Assistant's audio went to the speaker"


def test_speech_over_the_answer_is_a_barge_in(daemons: DaemonFactory, clips: dict[str, Clip]) -> None:
    vs = VadSettings(barge_in="stop")
    m = mix([clips["phrase1"]], [1.0], 3.5, "white", 25, seed=2)
    sink = MemorySink(24000)
    svc = daemons.start(sink=sink, local=FakeSynthesizer(), fallback=None,
                        wyoming={"zeroconf": "off", "satellite": SAT}, vad={"barge_in": "stop"})
    worker, _source = _mic(svc, m.pcm16, vs)

    async def home_assistant() -> list[Event]:
        async with AsyncTcpClient("127.0.0.1", _port(svc)) as ha:
            await ha.write_event(RunSatellite().event())
            await asyncio.sleep(0.1)
            await ha.write_event(AudioStart(16000, 2, 1).event())  # a 6 s answer, longer than the recording
            tone = (np.sin(np.arange(16000 * 6) * 0.05) * 8000).astype("<i2").tobytes()
            worker.start()  # the user talks while it plays

            async def feed() -> None:
                for i in range(0, len(tone), 3200):
                    await ha.write_event(AudioChunk(16000, 2, 1, tone[i:i + 3200]).event())
                await ha.write_event(AudioStop().event())

            feeder = asyncio.create_task(feed())
            got = await _read_until(ha, "played", 40)
            feeder.cancel()
            got += await _read_until(ha, "audio-stop", 20)
            return got

    try:
        got = asyncio.run(home_assistant())
    finally:
        worker.stop()
    kinds = [e.type for e in got]
    assert "played" in kinds and "run-pipeline" in kinds
    assert sink.played_seconds() < 5.0, "the answer was cut short by the barge-in"
    assert svc.metrics.registry.get_sample_value("cosyedge_barge_ins_total", {"action": "stop"}) == 1.0
