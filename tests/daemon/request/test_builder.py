"""The one builder: the defaults and limits a request gets do not depend on
the front end it came through (MQTT, Hermes, Wyoming); the limits hold at
their boundaries."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cosyedge_daemon.api.hermes import HermesError, parse_hermes_say
from cosyedge_daemon.api.tts_messages import parse_say
from cosyedge_daemon.request.builder import SEED_MAX, build_request
from cosyedge_daemon.request.errors import ApiError
from cosyedge_daemon.request.request import RequestLimits, request_limits
from cosyedge_daemon.settings.loader import settings_from_mapping
from cosyedge_models.synthesis.api import PromptAudio

LIMITS = RequestLimits(max_text_chars=10, max_prompt_s=1.0, default_voice="v0", default_output="both",
                       default_route="local", default_priority=7, default_deadline_ms=900)


def test_defaults_come_from_the_limits_the_settings_make() -> None:
    s = settings_from_mapping({"tts": {"max_text_chars": 10, "default_voice": "v0", "default_output": "auto"},
                               "routing": {"default_route": "cloud"},
                               "scheduler": {"default_priority": -3, "default_deadline_ms": 500}})
    with_sink, without = request_limits(s, has_sink=True), request_limits(s, has_sink=False)
    assert (with_sink.default_output, without.default_output) == ("play", "publish")
    r = build_request(with_sink, "Hello.")
    assert (r.voice, r.route, r.priority, r.deadline_ms, r.output) == ("v0", "cloud", -3, 500, "play")
    assert (r.mode, r.stream, r.speed, r.seed, r.client_id) == ("sft", True, 1.0, None, False)
    assert len(r.id) == 32 and int(r.id, 16) >= 0


def test_every_front_end_gets_the_same_defaults() -> None:
    mqtt = parse_say(json.dumps({"id": "m1", "text": "Hi."}).encode(), LIMITS)
    hermes = parse_hermes_say(json.dumps({"id": "h1", "text": "Hi.", "siteId": "s"}).encode(), LIMITS, ("s",),
                              "publish", 0.0)
    assert hermes is not None
    wyoming = build_request(LIMITS, "Hi.", id_prefix="wyoming-", output="publish")
    for r in (mqtt, hermes.request, wyoming):
        assert (r.voice, r.route, r.priority, r.deadline_ms, r.mode) == ("v0", "local", 7, 900, "sft")
    assert (mqtt.output, hermes.request.output, wyoming.output) == ("both", "publish", "publish")
    assert (mqtt.client_id, hermes.request.client_id, wyoming.client_id) == (True, True, False)
    assert wyoming.id.startswith("wyoming-") and len(wyoming.id) == len("wyoming-") + 16


def test_the_text_limit_is_the_same_for_every_front_end() -> None:
    assert build_request(LIMITS, "x" * 10).text == "x" * 10
    with pytest.raises(ApiError) as err:
        build_request(LIMITS, "x" * 11)
    assert err.value.code == "text_too_long" and "11 characters; the limit is 10" in err.value.message
    with pytest.raises(ApiError) as err:
        parse_say(json.dumps({"id": "m2", "text": "x" * 11}).encode(), LIMITS)
    assert (err.value.code, err.value.request_id) == ("text_too_long", "m2")
    with pytest.raises(HermesError, match="11 characters; the limit is 10"):
        parse_hermes_say(json.dumps({"text": "x" * 11, "siteId": "s"}).encode(), LIMITS, ("s",), "play", 0.0)


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"speed": 0.5}, None), ({"speed": 2.0}, None), ({"speed": 0.49}, "invalid_field"),
        ({"speed": 2.01}, "invalid_field"),
        ({"priority": 1000}, None), ({"priority": 1001}, "invalid_field"), ({"priority": -1001}, "invalid_field"),
        ({"seed": 0}, None), ({"seed": SEED_MAX}, None), ({"seed": SEED_MAX + 1}, "invalid_field"),
        ({"seed": -1}, "invalid_field"),
        ({"deadline_ms": 1}, None), ({"deadline_ms": 0}, "invalid_field"),
        ({"deadline_ms": 86_400_001}, "invalid_field"),
        ({"voice": "v" * 128}, None), ({"voice": "v" * 129}, "unknown_voice"),
        ({"mode": "chant"}, "unknown_mode"), ({"mode": "instruct"}, "invalid_field"),
        ({"mode": "instruct", "instruct_text": "calm"}, None), ({"mode": "zero_shot"}, "invalid_field"),
        ({"mode": "zero_shot", "voice": "v1"}, None), ({"output": "shout"}, "invalid_field"),
        ({"route": "moon"}, "invalid_field"),
    ],
)
def test_limits_at_their_boundaries(fields: dict[str, object], code: str | None) -> None:
    if code is None:
        build_request(LIMITS, "Hi.", **fields)  # type: ignore[arg-type]
        return
    with pytest.raises(ApiError) as err:
        build_request(LIMITS, "Hi.", request_id="b1", **fields)  # type: ignore[arg-type]
    assert (err.value.code, err.value.request_id) == (code, "b1")


def test_the_prompt_length_limit() -> None:
    ok = PromptAudio(pcm=np.zeros(16000, np.float32), sample_rate=16000, text="t")
    long = PromptAudio(pcm=np.zeros(16001, np.float32), sample_rate=16000, text="t")
    assert build_request(LIMITS, "Hi.", mode="zero_shot", prompt=ok).prompt is ok
    with pytest.raises(ApiError) as err:
        build_request(LIMITS, "Hi.", mode="zero_shot", prompt=long)
    assert err.value.code == "invalid_prompt" and "the limit is 1.0 s" in err.value.message


def test_empty_text_is_refused() -> None:
    with pytest.raises(ApiError) as err:
        build_request(LIMITS, " \n ")
    assert err.value.code == "invalid_field"
