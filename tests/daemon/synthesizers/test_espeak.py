from __future__ import annotations

import struct
import threading
from pathlib import Path

import numpy as np
import pytest
from cosyedge_daemon.synthesizers.espeak import EspeakSynthesizer, pcm_from_wav_stream, sentence_chunks
from cosyedge_models.errors import RequestError, SynthesisError
from cosyedge_models.synthesis.api import SynthesisRequest

from tests.support.components import require_binary


@pytest.fixture(scope="module")
def engine() -> EspeakSynthesizer:
    require_binary("espeak-ng", "apt-get install espeak-ng")
    return EspeakSynthesizer(voice="en-us", sample_rate=24000)


def test_sentence_chunks_use_the_models_splitter() -> None:
    assert sentence_chunks("One. Two!  Three?\nFour") == ["One.", "Two!", "Three?", "Four."]
    assert sentence_chunks("你好。世界！") == ["你好。", "世界！"]
    parts = sentence_chunks("word " * 200, max_chars=100)
    assert all(len(p) <= 101 for p in parts) and " ".join(parts).replace(".", "").split() == ["word"] * 200
    assert sentence_chunks("...") == ["..."]  # punctuation only: one chunk, not none


def test_streams_one_chunk_per_sentence_at_the_output_rate(engine: EspeakSynthesizer) -> None:
    chunks = list(engine.synthesize(SynthesisRequest(text="Hello there. How are you? Fine.")))
    assert [c.index for c in chunks] == [0, 1, 2]
    assert [c.last for c in chunks] == [False, False, True]
    assert all(c.sample_rate == 24000 and c.pcm.dtype == np.float32 for c in chunks)
    total = sum(c.pcm.size for c in chunks) / 24000
    assert 1.0 < total < 6.0
    assert np.abs(chunks[0].pcm).max() > 0.05  # speech, not silence
    assert chunks[0].times.first_audio_ms is not None and chunks[-1].times.vocoder_ms > 0
    whole = list(engine.synthesize(SynthesisRequest(text="Hello there. How are you?", stream=False)))
    assert len(whole) == 1 and whole[0].last


def test_resampled_rate_and_speed(engine: EspeakSynthesizer) -> None:
    e16 = EspeakSynthesizer(sample_rate=16000)
    slow = sum(c.pcm.size for c in e16.synthesize(SynthesisRequest(text="testing one two three", speed=0.6)))
    fast = sum(c.pcm.size for c in e16.synthesize(SynthesisRequest(text="testing one two three", speed=1.8)))
    assert slow > 1.5 * fast


def test_validation(engine: EspeakSynthesizer) -> None:
    with pytest.raises(RequestError) as err:
        engine.validate(SynthesisRequest(text="x", voice="klingon"))
    assert err.value.code == "unknown_voice"
    with pytest.raises(RequestError) as err:
        engine.validate(SynthesisRequest(text="x", mode="instruct", instruct_text="y"))
    assert err.value.code == "unsupported_mode"
    assert "en-us" in engine.voices() and engine.modes() == ("sft",)
    engine.validate(SynthesisRequest(text="x", voice="de"))


def test_cancel_stops_between_and_within_sentences(engine: EspeakSynthesizer) -> None:
    cancel = threading.Event()
    out = []
    for chunk in engine.synthesize(SynthesisRequest(text="One. Two. Three. Four."), cancel=cancel):
        out.append(chunk)
        cancel.set()
    assert len(out) == 1


def test_cancel_kills_a_running_process(tmp_path: Path) -> None:
    slow = tmp_path / "espeak-ng"
    slow.write_text('#!/bin/sh\nif [ "$1" = --voices ]; then exec espeak-ng --voices; fi\nsleep 30\n')
    slow.chmod(0o755)
    e = EspeakSynthesizer(binary=str(slow))
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    result: list[list[object]] = []
    worker = threading.Thread(target=lambda: result.append(list(e.synthesize(SynthesisRequest(text="x"),
                                                                             cancel=cancel))))
    worker.start()
    worker.join(20)  # the fake espeak-ng sleeps 30 s: returning before that means the cancel killed it
    assert not worker.is_alive() and result == [[]]


def test_missing_binary_and_failing_binary(tmp_path: Path) -> None:
    with pytest.raises(SynthesisError, match="apt-get install espeak-ng"):
        EspeakSynthesizer(binary="/nonexistent/espeak-ng")
    with pytest.raises(SynthesisError, match="no voice"):
        EspeakSynthesizer(voice="klingon")
    broken = tmp_path / "espeak-ng"
    broken.write_text(
        '#!/bin/sh\nif [ "$1" = --voices ]; then exec espeak-ng --voices; fi\n'
        "echo 'Error: broken' >&2; exit 3\n"
    )
    broken.chmod(0o755)
    e = EspeakSynthesizer(binary=str(broken))
    with pytest.raises(SynthesisError, match="exit 3"):
        list(e.synthesize(SynthesisRequest(text="x")))


def test_wav_stream_parsing() -> None:
    with pytest.raises(SynthesisError):
        pcm_from_wav_stream(b"garbage")
    # espeak-ng's streamed header: placeholder sizes (0xFFFFFFFF), then data to the end
    fmt = struct.pack("<HHIIHH", 1, 1, 22050, 44100, 2, 16)
    samples = np.array([0, 1000, -1000, 32767, -32768], dtype="<i2")
    stream = (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt
              + b"data" + struct.pack("<I", 0xFFFFFFFF) + samples.tobytes() + b"\x01")  # odd trailing byte
    pcm, rate = pcm_from_wav_stream(stream)
    assert rate == 22050 and pcm.tolist() == samples.tolist()
    stereo = stream.replace(fmt, struct.pack("<HHIIHH", 1, 2, 22050, 88200, 4, 16))
    with pytest.raises(SynthesisError, match="2 channels of 16 bits"):
        pcm_from_wav_stream(stereo)
