"""The Wyoming TTS server inside the daemon, on loopback, with the `wyoming`
package's own client standing where Home Assistant would: describe/info,
synthesize streamed as produced, streaming synthesis with text split at
awkward places, concurrent clients, and the trace/route of its requests."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest
from wyoming.audio import AudioChunk
from wyoming.client import AsyncTcpClient
from wyoming.info import Describe, Info
from wyoming.ping import Ping
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeVoice

from tests.daemon.conftest import DaemonFactory
from tests.support.fake_synthesizer import FakeSynthesizer, GatedSynthesizer
from tests.support.wyoming_client import exchange, raw_frame, read_raw_events, run, tts_port, types

WY = {"uri": "tcp://127.0.0.1:0", "zeroconf": "off"}


def test_describe_gives_one_streaming_tts_program(daemons: DaemonFactory) -> None:
    svc = daemons.start(local=FakeSynthesizer(), fallback=None, wyoming=WY)
    got = run(exchange(tts_port(svc), [Describe().event()], ("info",)))
    info = Info.from_event(got[-1])
    assert len(info.tts) == 1
    prog = info.tts[0]
    assert prog.name == "cosyedge" and prog.supports_synthesize_streaming and prog.installed
    assert prog.attribution.name and prog.version
    assert [v.name for v in prog.voices] == ["default"] and "en" in prog.voices[0].languages


def test_synthesize_streams_chunks_as_produced(daemons: DaemonFactory) -> None:
    engine = GatedSynthesizer(chunks=3)
    svc = daemons.start(local=engine, fallback=None, wyoming=WY)

    async def scenario() -> list[str]:
        seen = []
        async with AsyncTcpClient("127.0.0.1", tts_port(svc)) as client:
            await client.write_event(Synthesize(text="Hello there.").event())
            while (e := await asyncio.wait_for(client.read_event(), 20)) is not None:
                seen.append(e.type)
                if e.type == "audio-chunk" and not engine.gate.is_set():
                    chunk = AudioChunk.from_event(e)
                    assert (chunk.rate, chunk.width, chunk.channels) == (24000, 2, 1)
                    assert len(chunk.audio) == engine.chunk_samples * 2
                    engine.gate.set()  # the engine makes the rest only now: the first chunk was streamed
                if e.type == "audio-stop":
                    return seen
        return seen

    assert run(scenario()) == ["audio-start"] + ["audio-chunk"] * 3 + ["audio-stop"]
    assert engine.started == ["Hello there."]


def test_streaming_synthesis_sentences_as_they_complete(daemons: DaemonFactory) -> None:
    engine = FakeSynthesizer(chunks=2)
    svc = daemons.start(local=engine, fallback=None, wyoming=WY)
    text = "Hello wor" "ld. Pi is 3" ".14 today! Zwei Sätze… ok? 你好。世" "界！ and the end"
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]  # mid-word, mid-sentence, mid-number
    events = [SynthesizeStart(voice=SynthesizeVoice(name="default")).event()]
    events += [SynthesizeChunk(text=p).event() for p in pieces]
    events += [Synthesize(text=text).event(), SynthesizeStop().event()]  # the legacy event is ignored
    got = run(exchange(tts_port(svc), events, ("synthesize-stopped", "error")))
    assert engine.started == ["Hello world.", "Pi is 3.14 today!", "Zwei Sätze… ok?", "你好。", "世界！",
                              "and the end"]
    assert types(got) == (["audio-start", "audio-chunk", "audio-chunk", "audio-stop"] * 6
                          + ["synthesize-stopped"])


def test_first_sentence_is_synthesized_before_the_stream_ends(daemons: DaemonFactory) -> None:
    engine = FakeSynthesizer(chunks=1)
    svc = daemons.start(local=engine, fallback=None, wyoming=WY)

    async def scenario() -> list[str]:
        async with AsyncTcpClient("127.0.0.1", tts_port(svc)) as client:
            await client.write_event(SynthesizeStart().event())
            await client.write_event(SynthesizeChunk(text="First one. Sec").event())
            first = [(await asyncio.wait_for(client.read_event(), 20)).type for _ in range(3)]  # type: ignore[union-attr]
            await client.write_event(SynthesizeChunk(text="ond one.").event())
            await client.write_event(SynthesizeStop().event())
            rest = []
            while (e := await asyncio.wait_for(client.read_event(), 20)) is not None:
                rest.append(e.type)
                if e.type == "synthesize-stopped":
                    break
            return first + rest

    assert run(scenario()) == ["audio-start", "audio-chunk", "audio-stop"] * 2 + ["synthesize-stopped"]
    assert engine.started == ["First one.", "Second one."]


def test_utf8_split_across_tcp_segments_and_unknown_events(daemons: DaemonFactory) -> None:
    engine = FakeSynthesizer(chunks=1)
    svc = daemons.start(local=engine, fallback=None, wyoming=WY)
    frames = raw_frame("no-such-event", {"x": 1}) + raw_frame("synthesize", {"text": "Grüße, 世界。"})
    with socket.create_connection(("127.0.0.1", tts_port(svc))) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(len(frames)):  # one byte a segment: every multi-byte character is split
            s.sendall(frames[i:i + 1])
            time.sleep(0.001)
        s.settimeout(20)
        buf = b""
        while b'"audio-stop"' not in buf:
            part = s.recv(65536)
            assert part, "server closed early"
            buf += part
    assert engine.started == ["Grüße, 世界。"]


def test_ping_and_empty_text(daemons: DaemonFactory) -> None:
    svc = daemons.start(local=FakeSynthesizer(), fallback=None, wyoming=WY)
    got = run(exchange(tts_port(svc), [Ping(text="p").event()], ("pong",)))
    assert got[-1].data.get("text") == "p"
    got = run(exchange(tts_port(svc), [Synthesize(text="   ").event()], ("error",)))
    assert got[-1].data["code"] == "invalid_field"


def test_concurrent_clients_each_get_their_own_audio(daemons: DaemonFactory) -> None:
    texts = [f"Client number {n}." for n in range(4)]
    engine = FakeSynthesizer(chunks=2, levels={t: 0.1 * (n + 1) for n, t in enumerate(texts)})
    svc = daemons.start(local=engine, fallback=None, wyoming=WY, tts={"synthesis_workers": 2})

    async def all_clients() -> list[list]:  # type: ignore[type-arg]
        return await asyncio.gather(*(
            exchange(tts_port(svc), [Synthesize(text=t).event()], ("audio-stop", "error")) for t in texts))

    for n, got in enumerate(run(all_clients())):
        chunks = [AudioChunk.from_event(e) for e in got if e.type == "audio-chunk"]
        assert len(chunks) == 2, types(got)
        level = np.frombuffer(b"".join(c.audio for c in chunks), "<i2") / 32767.0
        assert np.allclose(level, 0.1 * (n + 1), atol=1e-3)


def test_requests_share_the_scheduler_trace_and_metrics(daemons: DaemonFactory,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    svc = daemons.start(local=FakeSynthesizer(chunks=1), fallback=None, wyoming=WY)
    with caplog.at_level(logging.INFO, logger="cosyedge_daemon.trace"):
        run(exchange(tts_port(svc), [Synthesize(text="Traced.").event()], ("audio-stop",)))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any("wyoming-" in r.message for r in caplog.records):
            time.sleep(0.02)
    lines = [json.loads(r.message) for r in caplog.records if r.name == "cosyedge_daemon.trace"]
    line = next(x for x in lines if x["id"].startswith("wyoming-"))
    assert (line["outcome"], line["route"], line["output"]) == ("completed", "local", "publish")
    assert svc.metrics.registry.get_sample_value(
        "cosyedge_tts_requests_total", {"route": "local", "outcome": "completed"}) == 1.0


def test_busy_when_the_queue_is_full(daemons: DaemonFactory) -> None:
    engine = FakeSynthesizer(chunks=1)
    svc = daemons.start(local=engine, fallback=None, wyoming=WY, scheduler={"max_queue": 1})

    def ask(n: int) -> Any:
        return exchange(tts_port(svc), [Synthesize(text=f"HOLD {n}").event()], ("audio-stop", "error"))

    async def scenario() -> list[list]:  # type: ignore[type-arg]
        first = asyncio.ensure_future(ask(0))
        while "HOLD 0" not in engine.seen:  # the first is being synthesized: one more may queue
            await asyncio.sleep(0.01)
        second = asyncio.ensure_future(ask(1))
        while svc.scheduler.depth < 1:  # queued behind it: the third finds the queue full
            await asyncio.sleep(0.01)
        third = await ask(2)
        engine.release.set()
        return [await first, await second, third]

    got = run(scenario())
    codes = [[e.data.get("code", e.type) for e in g if e.type in ("error", "audio-stop")] for g in got]
    assert codes == [["audio-stop"], ["audio-stop"], ["busy"]]
    assert svc.metrics.registry.get_sample_value("cosyedge_tts_rejected_total", {"code": "busy"}) == 1.0


def test_raw_events_frame_reader_matches_package(daemons: DaemonFactory) -> None:
    svc = daemons.start(local=FakeSynthesizer(chunks=1), fallback=None, wyoming=WY)
    with socket.create_connection(("127.0.0.1", tts_port(svc))) as s:
        s.sendall(raw_frame("describe"))
        s.shutdown(socket.SHUT_WR)
        got = read_raw_events(s)
    assert [e["type"] for e in got] == ["info"] and got[0]["data"]["tts"][0]["name"] == "cosyedge"


def test_back_to_back_requests_on_one_connection_do_not_interleave(daemons: DaemonFactory) -> None:
    """Two synthesize events (and a stream after them) sent at once, served by two workers,
    the second finishing first: each answer is one whole audio-start … audio-stop, in the
    order asked, as a client reading one stream needs."""
    engine = FakeSynthesizer(chunks=3, levels={"First HOLD.": 0.25, "Second one.": 0.5})
    svc = daemons.start(local=engine, fallback=None, wyoming=WY, tts={"synthesis_workers": 2})
    events = [Synthesize(text="First HOLD.").event(), Synthesize(text="Second one.").event(),
              SynthesizeStart().event(), SynthesizeChunk(text="Third. Fourth.").event(), SynthesizeStop().event()]

    def release_when_second_done() -> None:
        first = None
        while first is None:
            first = engine.seen.get("First HOLD.")
            time.sleep(0.01)
        first.entered.wait(20)
        second = None  # a second worker is free: give it the time to overtake (it must not)
        deadline = time.monotonic() + 0.5
        while second is None and time.monotonic() < deadline:
            second = engine.seen.get("Second one.")
            time.sleep(0.01)
        if second is not None:
            second.left.wait(5)
        engine.release.set()

    releaser = threading.Thread(target=release_when_second_done, daemon=True)
    releaser.start()
    got = run(exchange(tts_port(svc), events, ("synthesize-stopped", "error")))
    releaser.join(5)
    one = ["audio-start", "audio-chunk", "audio-chunk", "audio-chunk", "audio-stop"]
    assert types(got) == one * 4 + ["synthesize-stopped"]
    levels = [round(float(np.frombuffer(AudioChunk.from_event(e).audio, np.int16)[0]) / 32767, 2)
              for e in got if e.type == "audio-chunk"]
    assert levels[:6] == [0.25] * 3 + [0.5] * 3
