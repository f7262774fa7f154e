"""The VAD segmentation: on recorded human speech placed at known offsets in
silence and in noise (generated here), and its hysteresis logic on scripted
frame decisions."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf
from cosyedge_daemon.audio.interfaces import VadEvent
from cosyedge_daemon.audio.vad import Segmenter, Utterance, WebRtcClassifier, segment_pcm
from cosyedge_daemon.settings.audio import VadSettings

from tests.support.speech import Clip, load_clips, mix, require_speech_data

TOLERANCE_S = 0.090  # the bound on boundary errors

ARRANGEMENTS = [
    (["sentence", "digit", "phrase2"], 1.0, 1.2),
    (["phrase1", "sentence", "digit"], 1.37, 1.5),
    (["digit", "phrase2", "phrase1"], 1.74, 1.8),
]
CONDITIONS = [(None, 0.0), ("white", 20.0), ("white", 10.0), ("pink", 20.0), ("pink", 15.0)]


@pytest.fixture(scope="module")
def clips() -> dict[str, Clip]:
    data = require_speech_data()
    return load_clips(data)


def _arrange(clips: dict[str, Clip], k: int, noise: str | None, snr_db: float):  # type: ignore[no-untyped-def]
    names, first, gap = ARRANGEMENTS[k]
    offsets, t = [], first
    for name in names:
        offsets.append(t)
        t += len(clips[name].pcm) / 16000 + gap
    return mix([clips[n] for n in names], offsets, t + 0.5, noise, snr_db, seed=k)


def test_speech_clips_are_real_speech(clips: dict[str, Clip]) -> None:
    # the energy trim found the sentence, its phrases and a digit of plausible lengths
    lengths = {k: len(c.pcm) / 16000 for k, c in clips.items()}
    assert 4.0 < lengths["sentence"] < 4.8 and 0.8 < lengths["phrase1"] < 1.2
    assert 1.8 < lengths["phrase2"] < 2.3 and 0.5 < lengths["digit"] < 1.2


CONDITION_IDS = [f"{n or 'silence'}{int(s) or ''}" for n, s in CONDITIONS]


@pytest.mark.parametrize(("noise", "snr_db"), CONDITIONS, ids=CONDITION_IDS)
@pytest.mark.parametrize("arrangement", range(len(ARRANGEMENTS)))
def test_boundaries_on_speech_in_silence_and_noise(clips: dict[str, Clip], arrangement: int,
                                                   noise: str | None, snr_db: float) -> None:
    m = _arrange(clips, arrangement, noise, snr_db)
    found = segment_pcm(m.pcm16, VadSettings())
    got = [(round(u.start_s, 3), round(u.end_s, 3)) for u in found]
    assert len(found) == len(m.truth), f"detected {got}, placed {m.truth}"
    for u, (start, end) in zip(found, m.truth, strict=True):
        assert abs(u.start_s - start) <= TOLERANCE_S, f"start {u.start_s:.3f} vs {start:.3f}: {got}"
        assert abs(u.end_s - end) <= TOLERANCE_S, f"end {u.end_s:.3f} vs {end:.3f}: {got}"


def test_noise_alone_and_silence_give_no_segments() -> None:
    rng = np.random.default_rng(7)
    silence = np.zeros(16000 * 5, np.int16)
    noise = (rng.standard_normal(16000 * 5) * 0.01 * 32767).astype(np.int16)
    assert segment_pcm(silence, VadSettings()) == []
    assert segment_pcm(noise, VadSettings()) == []


def test_utterance_audio_has_pre_and_post_roll(clips: dict[str, Clip]) -> None:
    m = mix([clips["phrase2"]], [1.0], 4.0)
    vs = VadSettings(pre_roll_ms=300, post_roll_ms=150)
    (u,) = segment_pcm(m.pcm16, vs)
    assert u.audio_start_s == pytest.approx(u.start_s - 0.3, abs=1e-6)
    assert len(u.pcm) / 2 / 16000 == pytest.approx(u.end_s + 0.15 - u.audio_start_s, abs=1e-6)
    start = int(round(u.audio_start_s * 16000))
    assert np.array_equal(np.frombuffer(u.pcm, np.int16), m.pcm16[start:start + len(u.pcm) // 2])


def test_max_utterance_forces_a_split(clips: dict[str, Clip]) -> None:
    m = mix([clips["sentence"]], [1.0], 7.0)
    seg = Segmenter(VadSettings(max_utterance_ms=2000))
    outs = []
    for i in range(0, len(m.pcm16) - 480 + 1, 480):
        outs += seg.process(m.pcm16[i:i + 480].tobytes(), i / 16000)
    outs += seg.flush()
    events = [o for o in outs if isinstance(o, VadEvent)]
    utts = [o for o in outs if isinstance(o, Utterance)]
    assert [e.kind for e in events] == ["speech_start", "speech_end"] * len(utts) and len(utts) >= 2
    assert utts[0].forced_split and events[1].forced_split
    assert 2000 <= utts[0].duration_ms < 2030  # whole frames
    assert utts[1].start_s == pytest.approx(utts[0].end_s)  # continues without a gap
    assert not utts[-1].forced_split and abs(utts[-1].end_s - m.truth[0][1]) <= TOLERANCE_S


# --- the hysteresis on scripted decisions (30 ms frames) ------------------------

def _run(decisions: str, vs: VadSettings) -> list[VadEvent | Utterance]:
    """'1' voiced, '0' not, one character per frame; frames carry their index as PCM."""
    seg = Segmenter(vs, classify=lambda frame: True)  # not called: process_decision is
    out: list[VadEvent | Utterance] = []
    n = vs.frame_samples
    for i, d in enumerate(decisions):
        frame = np.zeros(n, np.int16)
        frame[0] = i  # the index, at an energy far below any speech (no onset refinement)
        out += seg.process_decision(frame.tobytes(), i * vs.frame_ms / 1000, d == "1")
    return out + seg.flush()


VS = VadSettings(start_window_ms=150, start_voiced_ms=90, hangover_ms=300, pre_roll_ms=60,
                 post_roll_ms=30, min_utterance_ms=210)


def test_start_needs_n_of_m_voiced_frames_and_min_utterance() -> None:
    assert _run("0" * 5 + "11000" * 4 + "0" * 20, VS) == []  # 2 of 5 never starts
    assert _run("0" * 5 + "1101" + "0" * 20, VS) == []  # starts, but 120 ms < min_utterance: no event
    out = _run("0" * 5 + "1101111" + "0" * 20, VS)
    assert [type(o).__name__ for o in out] == ["VadEvent", "VadEvent", "Utterance"]
    start, end, utt = out
    assert start == VadEvent("speech_start", pytest.approx(0.15))  # the first voiced frame of the window
    assert end.kind == "speech_end" and end.time_s == pytest.approx(0.36)
    assert utt.start_s == pytest.approx(0.15) and utt.end_s == pytest.approx(0.36)
    frames = np.frombuffer(utt.pcm, np.int16)[::VS.frame_samples].tolist()
    assert frames == list(range(3, 13))  # 2 frames of pre-roll, speech, 1 frame of post-roll


def test_hangover_bridges_pauses_and_ends_at_last_voiced_frame() -> None:
    out = _run("0" * 3 + "1" * 10 + "0" * 9 + "1" * 5 + "0" * 10 + "1" * 8 + "0" * 12, VS)
    utts = [o for o in out if isinstance(o, Utterance)]
    # a 270 ms pause (< 300 ms hangover) is bridged; 300 ms of silence ends the utterance
    assert [(round(u.start_s, 2), round(u.end_s, 2)) for u in utts] == [(0.09, 0.81), (1.11, 1.35)]
    kinds = [o.kind for o in out if isinstance(o, VadEvent)]
    assert kinds == ["speech_start", "speech_end", "speech_start", "speech_end"]


def test_onset_is_extended_back_over_loud_frames_the_detector_missed() -> None:
    seg = Segmenter(VS, classify=lambda frame: True)
    n = VS.frame_samples
    quiet, loud = np.zeros(n, np.int16), np.full(n, 3000, np.int16)  # loud: -21 dBFS
    out: list[VadEvent | Utterance] = []
    # a loud frame judged unvoiced (a plosive, say) right before the voiced run: the onset includes it
    for i, (frame, voiced) in enumerate([(quiet, False)] * 6 + [(loud, False)] + [(loud, True)] * 8):
        out += seg.process_decision(frame.tobytes(), i * 0.03, voiced)
    starts = [o for o in out if isinstance(o, VadEvent) and o.kind == "speech_start"]
    assert starts and starts[0].time_s == pytest.approx(0.18)


def test_flush_closes_an_open_utterance() -> None:
    out = _run("0" * 3 + "1" * 12, VS)  # stream ends mid-speech
    assert [o.kind for o in out if isinstance(o, VadEvent)] == ["speech_start", "speech_end"]
    assert [o for o in out if isinstance(o, Utterance)][0].end_s == pytest.approx(0.45)


@pytest.mark.parametrize(("mode", "frame_ms", "short", "long"), [(3, 30, 1, 2), (2, 10, 5, 8), (0, 20, 3, 6)])
def test_webrtc_hangover_table(mode: int, frame_ms: int, short: int, long: int) -> None:
    c = WebRtcClassifier(mode, frame_ms)
    # observed runs: true length + the detector's hangover; one frame of it is kept
    assert c.trailing_overhang(3 + short + 1) == short
    assert c.trailing_overhang(20) == long
    assert c.trailing_overhang(1) == 0


def test_real_frames_must_have_the_frame_length() -> None:
    seg = Segmenter(VadSettings(frame_ms=10))
    with pytest.raises(ValueError, match="expected 320"):
        seg.process(b"\x00" * 960, 0.0)


def test_segment_wav_is_16k_mono(clips: dict[str, Clip]) -> None:
    from cosyedge_models.pcm import wav_bytes

    m = mix([clips["digit"]], [0.5], 2.5)
    (u,) = segment_pcm(m.pcm16, VadSettings())
    y, rate = sf.read(io.BytesIO(wav_bytes(u.pcm, 16000)), dtype="int16")
    assert rate == 16000 and y.ndim == 1 and len(y) == len(u.pcm) // 2
