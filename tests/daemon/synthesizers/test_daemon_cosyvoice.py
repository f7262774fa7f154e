"""The daemon with the CosyVoice engine on the tiny bundle (the product's
engine; the other daemon suites use espeak-ng for speed): streamed chunks
and done over a real broker, a running request cancelled, bad input
answered while it keeps serving."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cosyedge_daemon.api.tts_messages import decode_audio
from cosyedge_models.synthesis.synthesizer import load_synthesizer

from tests.daemon.conftest import DaemonFactory, SynthesizerFactory


@pytest.fixture()
def engine_factory(tiny_bundle: Path) -> SynthesizerFactory:
    return lambda: load_synthesizer(tiny_bundle)


def test_say_streams_cosyvoice_chunks_then_done(daemons: DaemonFactory) -> None:
    svc = daemons.start()
    p = daemons.probe(svc)
    pre = svc.settings.topic_prefix
    p.publish(f"{pre}/tts/say", {"id": "cv1", "text": "Hello from the tiny model, one two three.",
                                 "output": "publish", "stream": True})
    done_msg = p.wait_topic(f"{pre}/tts/done/cv1", 120)
    done = done_msg.json()
    chunks = [decode_audio(c.payload, c.user_properties) for c in p.on(f"{pre}/tts/audio/cv1")]
    assert len(chunks) >= 2, "streaming gives several chunks"
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert chunks[-1].last and not any(c.last for c in chunks[:-1])
    assert {c.sample_rate for c in chunks} == {24000}
    pcm = np.frombuffer(b"".join(c.pcm16 for c in chunks), "<i2")
    assert pcm.size > 24000 and np.abs(pcm).max() > 0
    assert abs(pcm.size / 24000 - done["audio_seconds"]) < 0.01
    assert (done["route"], done["reason"]) == ("local", "completed")
    assert done["trace"]["llm_ms"] > 0 and done["trace"]["flow_ms"] > 0 and done["trace"]["vocoder_ms"] > 0


def test_bad_requests_answered_and_still_serving(daemons: DaemonFactory) -> None:
    svc = daemons.start()
    p = daemons.probe(svc)
    pre = svc.settings.topic_prefix
    p.publish(f"{pre}/tts/say", {"id": "bad1", "text": "x", "voice": "nobody"})
    assert p.wait_topic(f"{pre}/tts/error/bad1", 30).json()["code"] == "unknown_voice"
    p.publish(f"{pre}/tts/say", {"id": "bad2", "text": "Hi.", "mode": "instruct"})
    err = p.wait_topic(f"{pre}/tts/error/bad2", 30).json()
    assert err["code"] in ("invalid_field", "missing_instruct_text") and "instruct_text" in err["message"]
    p.publish(f"{pre}/tts/say", {"id": "ok", "text": "Still here.", "output": "publish"})
    assert p.wait_topic(f"{pre}/tts/done/ok", 120).json()["reason"] == "completed"
