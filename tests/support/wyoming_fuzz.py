"""Property-based fuzzing of the Wyoming TTS surface (hypothesis): sessions of
events a careless or hostile client sends on one connection, each step with
the exact answer it must get (an oracle written apart from the server):

- describe → one info; ping → one pong with its text; an unknown event → nothing;
- synthesize without a usable text → one error `invalid_field`;
- synthesize of any text that is not blank and within the limit → one
  audio-start, chunks, audio-stop (a text with nothing to speak too: then no
  chunks); of a text over the limit → one error `text_too_long`; with a voice
  that the engine does not have → one error `unknown_voice` (an empty name or
  `default` is the default voice);
- a stream (start, chunks, stop; chunks without a text string answered
  `invalid_field` each; the legacy synthesize inside ignored) → whole audio
  groups, then one synthesize-stopped;
- a chunk or stop without a start → one error `invalid_state`;
- a broken frame, last → one error with the framing's code, then the end.

The fuzzer reads each step's answers before the next step, then sends a ping:
its pong must come next, so nothing more than the oracle's answer arrived."""

from __future__ import annotations

import json
from dataclasses import dataclass

from hypothesis import strategies as st

from tests.support.fuzz import json_values, nasty_text, scalars
from tests.support.wyoming_client import raw_frame as frame

PLAIN = ["Hello there.", "A test.", "Pi is 3.14 today!", "Zwei Sätze, ok?", "你好。", "Yes"]
FRAME_CODES = ("invalid_header", "invalid_data", "event_too_large", "truncated")


@dataclass(frozen=True)
class Step:
    kind: str  # describe | ping | unknown | bad_synth | synth | stream | orphan | broken
    frames: bytes
    errors: tuple[str, ...] = ()  # error codes this step must get (in any order), besides its answer
    answer: str = ""  # info | pong | audio | stream | "" (errors only, or nothing)
    ping_text: str = ""


UNKNOWN_VOICE = "no-such-voice-"  # no engine has a voice of this name (and one over 128 characters is refused)


def _voice() -> st.SearchStrategy[dict[str, object] | None]:
    return st.one_of(st.none(), st.just({"name": "default"}), st.just({"name": ""}),
                     st.builds(lambda n: {"name": UNKNOWN_VOICE + n}, nasty_text))


@st.composite
def steps(draw: st.DrawFn, max_text_chars: int) -> Step:
    kind = draw(st.sampled_from(["describe", "ping", "unknown", "bad_synth", "synth", "synth", "synth",
                                 "stream", "stream", "orphan"]))
    if kind == "describe":
        return Step(kind, frame("describe"), answer="info")
    if kind == "ping":
        text = draw(st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=10))
        return Step(kind, frame("ping", {"text": text}), answer="pong", ping_text=text)
    if kind == "unknown":
        name = draw(st.text(min_size=1, max_size=12).filter(lambda t: not _known(t)))
        return Step(kind, frame(name, draw(st.dictionaries(nasty_text, scalars, max_size=3)) or None))
    if kind == "bad_synth":
        data = draw(st.one_of(st.just({}), st.builds(lambda t: {"text": t}, st.one_of(
            st.sampled_from(["", " ", "\n\t"]), st.integers(), st.none(), st.lists(st.integers(), max_size=2),
            json_values.filter(lambda v: not isinstance(v, str))))))
        return Step(kind, frame("synthesize", data or None), errors=("invalid_field",))
    if kind == "synth":
        how = draw(st.integers(0, 5))
        voice = draw(_voice())
        data: dict[str, object] = {}
        if how == 0:
            text = "a" * draw(st.integers(max_text_chars + 1, max_text_chars + 50))
            data = {"text": text}
            return Step(kind, frame("synthesize", data), errors=("text_too_long",))
        if how == 1:
            data = {"text": draw(nasty_text.filter(lambda t: t.strip() != ""))}
        else:
            data = {"text": draw(st.sampled_from(PLAIN))}
        if voice is not None:
            data["voice"] = voice
        # the text is checked first (a nasty text may be over the limit too), then the voice
        if len(str(data["text"])) > max_text_chars:
            return Step(kind, frame("synthesize", data), errors=("text_too_long",))
        if voice is not None and voice.get("name") not in ("", "default"):
            return Step(kind, frame("synthesize", data), errors=("unknown_voice",))
        return Step(kind, frame("synthesize", data), answer="audio")
    if kind == "stream":
        parts = [frame("synthesize-start", {"voice": {"name": "default"}} if draw(st.booleans()) else None)]
        errors: list[str] = []
        for _ in range(draw(st.integers(0, 5))):
            what = draw(st.integers(0, 7))
            if what == 0:
                parts.append(frame("synthesize-chunk", {"text": draw(st.one_of(st.integers(), st.none()))}))
                errors.append("invalid_field")
            elif what == 1:
                parts.append(frame("synthesize", {"text": "Ignored legacy text."}))
            else:
                text = draw(st.text(alphabet=st.sampled_from(list("ab c.!?é世界。")), max_size=20))
                parts.append(frame("synthesize-chunk", {"text": text}))
        parts.append(frame("synthesize-stop"))
        return Step(kind, b"".join(parts), errors=tuple(errors), answer="stream")
    which = draw(st.sampled_from(["synthesize-chunk", "synthesize-stop"]))
    return Step(kind, frame(which, {"text": "x"} if which == "synthesize-chunk" else None),
                errors=("invalid_state",))


@st.composite
def broken_frames(draw: st.DrawFn, max_event_bytes: int) -> bytes:
    """A last frame the reader must refuse (the connection then ends)."""
    how = draw(st.integers(0, 4))
    if how == 0:
        return b"{not json\n"
    if how == 1:
        return json.dumps({"type": "ping", "data_length": draw(st.one_of(st.integers(max_value=-1), nasty_text))
                           }).encode() + b"\n"
    if how == 2:
        return json.dumps({"type": "ping", "payload_length": max_event_bytes + draw(st.integers(1, 10**9))
                           }).encode() + b"\n"
    if how == 3:
        body = draw(st.binary(min_size=1, max_size=20).filter(lambda b: not _json_object(b)))
        return json.dumps({"type": "ping", "data_length": len(body)}).encode() + b"\n" + body
    return json.dumps(draw(st.one_of(st.lists(st.integers(), max_size=2), st.integers(), st.just({"x": 1})))
                      ).encode() + b"\n"


def _json_object(b: bytes) -> bool:
    try:
        return isinstance(json.loads(b), dict)
    except (ValueError, RecursionError):
        return False


def _known(t: str) -> bool:
    return t in {"describe", "ping", "pong", "synthesize", "synthesize-start", "synthesize-chunk",
                 "synthesize-stop", "info", "error", "audio-start", "audio-chunk", "audio-stop"}


@dataclass(frozen=True)
class Session:
    steps: tuple[Step, ...]
    broken: bytes | None
    cuts: tuple[int, ...]  # the client's writes are cut at these byte offsets (frames split anywhere)


@st.composite
def sessions(draw: st.DrawFn, max_text_chars: int, max_event_bytes: int) -> Session:
    chosen = tuple(draw(st.lists(steps(max_text_chars), min_size=1, max_size=4)))
    broken = draw(broken_frames(max_event_bytes)) if draw(st.integers(0, 5)) == 0 else None
    cuts = tuple(draw(st.lists(st.integers(1, 200), max_size=3)))
    return Session(chosen, broken, cuts)


def check_answer(step: Step, got: list[tuple[str, dict[str, object]]]) -> str | None:
    """None when `got` (event types and data, in order) is exactly what `step` must get."""
    codes = sorted(str(d.get("code")) for t, d in got if t == "error" and d.get("code") in step.errors)
    if codes != sorted(step.errors):
        return f"expected errors {sorted(step.errors)}, got {[(t, d.get('code')) for t, d in got if t == 'error']}"
    rest = [(t, d) for t, d in got if not (t == "error" and d.get("code") in step.errors)]
    kinds = [t for t, _ in rest]
    if step.answer == "":
        return None if not rest else f"expected nothing more, got {kinds}"
    if step.answer in ("info", "pong"):
        if kinds != [step.answer]:
            return f"expected one {step.answer}, got {kinds}"
        if step.answer == "pong" and rest[0][1].get("text", "") != step.ping_text:
            return f"pong text {rest[0][1].get('text')!r} != {step.ping_text!r}"
        return None
    audio_ok = _groups(kinds) == 1
    if step.answer == "audio":
        return None if audio_ok else f"expected one audio group, got {kinds}"
    if step.answer == "stream":
        ok = bool(kinds) and kinds[-1] == "synthesize-stopped" and _groups(kinds[:-1]) >= 0
        return None if ok else f"expected audio groups then synthesize-stopped, got {kinds}"
    raise ValueError(step.answer)


def _groups(kinds: list[str]) -> int:
    """How many whole audio-start, audio-chunk*, audio-stop groups `kinds` is; -1 if not only those."""
    n, inside = 0, False
    for k in kinds:
        if k == "audio-start" and not inside:
            inside = True
        elif k == "audio-chunk" and inside:
            pass
        elif k == "audio-stop" and inside:
            inside, n = False, n + 1
        else:
            return -1
    return -1 if inside else n


def terminal(step: Step, got: list[tuple[str, dict[str, object]]]) -> bool:
    """Whether the step's answer is complete (reading can stop)."""
    errors = sum(1 for t, d in got if t == "error" and d.get("code") in step.errors)
    kinds = [t for t, d in got if not (t == "error" and d.get("code") in step.errors)]
    if errors < len(step.errors):
        return False
    if step.answer in ("info", "pong"):
        return step.answer in kinds
    if step.answer == "audio":
        return bool(kinds) and kinds[-1] in ("audio-stop", "error")
    if step.answer == "stream":
        return "synthesize-stopped" in kinds or "error" in kinds
    return True
