"""A Wyoming TTS client as Home Assistant is one: `cosyedge say --wyoming
tcp://HOST:PORT TEXT` (prints the time to first audio), `describe` for
`cosyedge doctor`, and the benchmark's measurements. Built on the `wyoming`
package's own AsyncTcpClient."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from cosyedge_daemon.settings.wyoming import parse_tcp_uri
from cosyedge_models.errors import CosyEdgeError
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped, SynthesizeVoice


@dataclass
class Spoken:
    sample_rate: int = 0
    pcm16: bytearray = field(default_factory=bytearray)
    chunks: int = 0
    streams: int = 0  # audio-start … audio-stop pairs
    sent_at: float = 0.0  # synthesize (or synthesize-stop when streaming) written
    first_audio_at: float | None = None
    error: Error | None = None

    @property
    def first_audio_ms(self) -> float | None:
        return None if self.first_audio_at is None else (self.first_audio_at - self.sent_at) * 1000.0


def _pieces(text: str, size: int) -> list[str]:
    """Text cut every `size` characters (mid-word), as an LLM would stream it."""
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


async def synthesize(uri: str, text: str, *, voice: str | None = None, stream: bool = False,
                     chunk_chars: int = 7, timeout_s: float = 120.0) -> Spoken:
    host, port = parse_tcp_uri(uri, "--wyoming")
    out = Spoken()
    v = SynthesizeVoice(name=voice) if voice else None
    async with AsyncTcpClient(host, port) as client:
        if stream:
            await client.write_event(SynthesizeStart(voice=v).event())
            for piece in _pieces(text, chunk_chars):
                await client.write_event(SynthesizeChunk(text=piece).event())
            await client.write_event(Synthesize(text=text, voice=v).event())  # for servers without streaming
            out.sent_at = time.perf_counter()
            await client.write_event(SynthesizeStop().event())
        else:
            out.sent_at = time.perf_counter()
            await client.write_event(Synthesize(text=text, voice=v).event())
        await asyncio.wait_for(_collect(client, out, stream), timeout_s)
    return out


async def _collect(client: AsyncTcpClient, out: Spoken, stream: bool) -> None:
    while True:
        event: Event | None = await client.read_event()
        if event is None:
            raise CosyEdgeError("the Wyoming server closed the connection before the audio ended")
        if AudioChunk.is_type(event.type):
            if out.first_audio_at is None:
                out.first_audio_at = time.perf_counter()
            chunk = AudioChunk.from_event(event)
            out.sample_rate = chunk.rate
            out.pcm16 += chunk.audio
            out.chunks += 1
        elif AudioStart.is_type(event.type):
            out.sample_rate = AudioStart.from_event(event).rate
        elif AudioStop.is_type(event.type):
            out.streams += 1
            if not stream:
                return
        elif SynthesizeStopped.is_type(event.type) and stream:
            return
        elif Error.is_type(event.type):
            out.error = Error.from_event(event)
            return


async def describe(uri: str, timeout_s: float = 5.0) -> Info:
    host, port = parse_tcp_uri(uri, "uri")

    async def ask() -> Info:
        async with AsyncTcpClient(host, port) as client:
            await client.write_event(Describe().event())
            while (event := await client.read_event()) is not None:
                if Info.is_type(event.type):
                    return Info.from_event(event)
        raise CosyEdgeError(f"{uri} closed the connection without answering describe")

    return await asyncio.wait_for(ask(), timeout_s)
