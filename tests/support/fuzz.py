"""Property-based fuzzing of the daemon's input surfaces with hypothesis:
strategies for payloads (native say/cancel/admin, Hermes, MQTT v5
properties, config files) and, for each generated message, how many answers
it must get (an oracle written apart from the daemon's parsers). The
Wyoming surface has its own, per session step: tests/support/wyoming_fuzz.py.

Every case says where its answers go and how many must arrive: exactly one
done/error for every say, one error for a malformed cancel or admin message
(none for a valid one), one sayFinished for a Hermes say of our site (none
for another site's)."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass

from hypothesis import strategies as st

ID_RE = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")  # the documented id alphabet (docs/reliability.md)
SAY_FIELDS = ("id", "text", "voice", "mode", "instruct_text", "prompt", "output", "route", "priority",
              "stream", "deadline_ms", "speed", "seed")


@dataclass(frozen=True)
class Case:
    surface: str  # say | cancel | admin | hermes
    topic_suffix: str  # below the prefix, or a full topic for Hermes
    payload: bytes
    answers: int  # exactly this many terminal answers
    response_topic: str | None = None
    correlation: bytes | None = None
    user_properties: tuple[tuple[str, str], ...] = ()  # MQTT v5 (read by the daemon, never trusted)


# --- JSON values a careless or hostile client sends ----------------------------------
huge_ints = st.integers(min_value=4301, max_value=6000).map(lambda n: b"7" * n)  # digits beyond Python's limit
nasty_text = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=20),
    st.sampled_from(["", " ", "\n", "a\n", "nl\n", "\x00", "a/+/#", "🙂", "\u202e", "a" * 129]),
)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False), nasty_text,
)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(nasty_text, inner, max_size=4)), max_leaves=12)

ids = st.one_of(st.from_regex(ID_RE, fullmatch=True), nasty_text, st.integers(), st.none())
plausible = {
    "text": st.one_of(st.sampled_from(["Hi.", "A test."]), nasty_text, st.integers()),
    "voice": st.one_of(st.none(), nasty_text, st.just("v" * 5000)),
    "mode": st.one_of(st.sampled_from(["sft", "zero_shot", "cross_lingual", "instruct"]), nasty_text),
    "instruct_text": st.one_of(st.none(), nasty_text),
    "prompt": st.one_of(st.none(), json_values, st.fixed_dictionaries({"wav": nasty_text, "text": nasty_text})),
    "output": st.one_of(st.just("publish"), st.sampled_from(["play", "both"]), nasty_text),
    "route": st.one_of(st.sampled_from(["auto", "local", "cloud"]), nasty_text),
    "priority": st.one_of(st.integers(min_value=-2000, max_value=2000), scalars),
    "stream": st.one_of(st.booleans(), scalars),
    "deadline_ms": st.one_of(st.integers(min_value=-5, max_value=10**9), scalars),
    "speed": st.one_of(st.floats(min_value=0, max_value=3), scalars),
    "seed": st.one_of(st.integers(min_value=-5, max_value=2**33), scalars),
}


@st.composite
def say_objects(draw: st.DrawFn) -> dict[str, object]:
    obj: dict[str, object] = {}
    if draw(st.booleans()):
        obj["id"] = draw(ids)
    obj["text"] = draw(plausible["text"])
    obj["output"] = "publish"  # no sound card: play/both are refused, publish is served
    for name in draw(st.lists(st.sampled_from(SAY_FIELDS[2:]), max_size=4, unique=True)):
        obj[name] = draw(plausible[name]) if name in plausible else draw(scalars)
    if draw(st.integers(0, 9)) == 0:
        obj[draw(nasty_text)] = draw(scalars)  # an unknown field
    return obj


@st.composite
def broken(draw: st.DrawFn, body: bytes) -> bytes:
    """`body` or one of the ways it arrives damaged."""
    how = draw(st.integers(0, 9))
    if how == 0:
        return body[: draw(st.integers(0, max(0, len(body) - 1)))]  # truncated
    if how == 1:
        at = draw(st.integers(0, len(body)))
        return body[:at] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80"])) + body[at:]
    if how == 2:
        return body.replace(b"}", b', "x": ' + draw(huge_ints) + b"}", 1)
    if how == 3:
        return draw(st.binary(max_size=64))
    if how == 4:
        return json.dumps(draw(json_values)).encode()
    return body


def dumps(obj: object) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")


def _decoded(payload: bytes, max_bytes: int) -> object:
    """The JSON value, or a sentinel when the daemon cannot decode it."""
    if not payload or len(payload) > max_bytes:
        return _BAD
    try:
        return json.loads(payload.decode("utf-8"))
    except (ValueError, RecursionError):
        return _BAD


_BAD = object()


def mosquitto_accepts(s: str) -> bool:
    """Whether Mosquitto takes `s` as an MQTT UTF-8 string. It disconnects a client
    that sends a control character, a surrogate or a Unicode noncharacter
    (U+FDD0-U+FDEF, U+xFFFE, U+xFFFF) as a malformed packet; paho checks none of
    the last, so the fuzzer must not send them (its own connection would drop)."""
    for c in s:
        o = ord(c)
        if o < 0x20 or 0x7F <= o <= 0x9F or 0xD800 <= o <= 0xDFFF or 0xFDD0 <= o <= 0xFDEF or (o & 0xFFFE) == 0xFFFE:
            return False
    return True


def valid_ref(value: object) -> bool:
    return isinstance(value, str) and ID_RE.fullmatch(value) is not None


@st.composite
def cases(draw: st.DrawFn, prefix: str, site: str, max_bytes: int) -> Case:
    surface = draw(st.sampled_from(["say", "say", "say", "cancel", "admin", "hermes", "hermes"]))
    rt = draw(st.one_of(st.none(), st.sampled_from(
        ["fzreply/c1", "a/+/b", "#", f"{prefix}/tts/say", "hermes/tts/say", "fzreply/\n"]), nasty_text))
    corr = draw(st.one_of(st.none(), st.binary(max_size=16)))
    if rt is not None and not mosquitto_accepts(rt):
        rt = None  # Mosquitto itself drops a client that sends such a string (malformed packet)
    printable = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=12)
    props = tuple(draw(st.lists(st.tuples(printable, printable), max_size=3)))
    if surface == "say":
        payload = draw(broken(dumps(draw(say_objects()))))
        if draw(st.integers(0, 30)) == 0:
            payload = b'{"id": "big", "text": "' + b"a" * (max_bytes + 10) + b'"}'
        return Case("say", "tts/say", payload, 1, rt or None, corr, props)
    if surface == "cancel":
        payload = draw(broken(dumps({"id": draw(ids)})))
        obj = _decoded(payload, max_bytes)
        ok = isinstance(obj, dict) and valid_ref(obj.get("id"))
        return Case("cancel", "tts/cancel", payload, 0 if ok else 1)
    if surface == "admin":
        # Mostly damaged reloads; a valid one ({} or a bundle path) reloads the (espeak-ng) engine.
        payload = draw(st.one_of(
            st.just(b'{"bundle": 5}'), st.binary(min_size=1, max_size=40).filter(lambda b: b.strip() != b""),
            st.builds(lambda v: dumps([v]), json_values)))
        obj = _decoded(payload, max_bytes)
        ok = isinstance(obj, dict) and (obj.get("bundle") is None or isinstance(obj.get("bundle"), str))
        return Case("admin", "admin/reload", payload, 0 if ok else 1)
    ours = draw(st.booleans())
    obj = {"siteId": site if ours else draw(st.sampled_from(["other", "default", "kitchen2"]))}
    body = dumps(obj)[:-1] + b", " + dumps({k: v for k, v in draw(say_objects()).items()
                                            if k in ("id", "text")})[1:]
    if draw(st.booleans()):
        body = body[:-1] + b', "sessionId": ' + dumps(draw(scalars)) + b"}"
    payload = draw(broken(body))
    head = dumps(obj)[:-1]
    if not payload.startswith(head):
        payload = body  # the site must stay readable so the oracle knows whose message it is
    return Case("hermes", "hermes/tts/say", payload, 1 if ours else 0)


class AnswerCounter:
    """Counts terminal answers on the topics given (an MQTT on_message hook)."""

    def __init__(self, terminal: tuple[str, ...]) -> None:
        self.terminal = terminal
        self.count = 0
        self.offline = 0
        self._cond = threading.Condition()

    def on_message(self, topic: str, payload: bytes) -> None:
        if topic.endswith("/status") and payload == b"offline":
            self.offline += 1
        if any(topic.startswith(t) for t in self.terminal):
            with self._cond:
                self.count += 1
                self._cond.notify_all()

    def wait_at_least(self, n: int, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.count >= n, timeout_s)


# --- config files -----------------------------------------------------------------------
def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value) if not isinstance(value, float) or value == value else "nan"
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(value)


toml_scalars = st.one_of(st.booleans(), st.integers(min_value=-(2**63), max_value=2**63 - 1),
                         st.floats(allow_nan=False, allow_infinity=True), nasty_text)
toml_values = st.one_of(toml_scalars, st.lists(st.one_of(nasty_text, st.integers()), max_size=3))


@st.composite
def config_files(draw: st.DrawFn, schema: dict[str, list[str]]) -> bytes:
    """A TOML config: known sections and keys (from `schema`) with arbitrary
    values, sometimes unknown ones, sometimes damaged bytes."""
    lines: list[str] = []
    if draw(st.booleans()):
        device = draw(st.one_of(nasty_text, st.from_regex(r"[a-z]{1,8}", fullmatch=True)))
        lines.append(f"device_id = {toml_value(device)}")
    for section in draw(st.lists(st.sampled_from(sorted(schema)), max_size=4, unique=True)):
        lines.append(f"[{section}]")
        keys = schema[section] or ["x"]
        for key in draw(st.lists(st.sampled_from(keys), max_size=4, unique=True)):
            lines.append(f"{key} = {toml_value(draw(toml_values))}")
        if draw(st.integers(0, 9)) == 0:
            lines.append(f"{json.dumps(draw(nasty_text))} = 1")
    body = ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass")
    how = draw(st.integers(0, 9))
    if how == 0:
        return body[: draw(st.integers(0, len(body)))]
    if how == 1:
        return body + draw(st.binary(max_size=20))
    return body
