"""The route=auto rules and the fallback chain, alone: real espeak-ng engines
stand in the slots (the router only asks an engine for its modes, voices,
validation and availability)."""

from __future__ import annotations

import dataclasses

import pytest
from cosyedge_daemon.request.errors import ApiError
from cosyedge_daemon.request.request import TtsRequest
from cosyedge_daemon.settings.schema import RoutingSettings
from cosyedge_daemon.synthesizers.espeak import EspeakSynthesizer
from cosyedge_daemon.synthesizers.routing import RouteDecision, Router, SynthesizerSet, count_tokens
from cosyedge_models.synthesis.api import PromptAudio

from tests.support.components import require_binary


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Unreachable(EspeakSynthesizer):
    """An engine that says it cannot be reached (as the cloud does when its link is down)."""

    up = False

    def available(self) -> bool:
        return self.up


@pytest.fixture()
def espeak() -> EspeakSynthesizer:
    require_binary("espeak-ng", "apt-get install espeak-ng")
    return EspeakSynthesizer()


def make(espeak: EspeakSynthesizer, *, cloud: bool = True, load: tuple[int, float] = (0, 0.0), **rules: object):
    settings = dataclasses.replace(RoutingSettings(), **rules)  # type: ignore[arg-type]
    engines = SynthesizerSet(settings)
    engines.slots["local"].swap(espeak)
    engines.slots["fallback"].swap(espeak)
    if cloud:
        engines.slots["cloud"].swap(espeak)
    clock = Clock()
    router = Router(engines, settings, load=lambda _r: load, clock=clock)
    return router, engines, clock


def req(text: str = "hello", **kw: object) -> TtsRequest:
    return TtsRequest(id="r", text=text, **kw)  # type: ignore[arg-type]


def test_text_length_by_chars_and_tokens(espeak: EspeakSynthesizer) -> None:
    router, _, _ = make(espeak, cloud_min_chars=50, cloud_min_tokens=0)
    assert router.decide(req("short")).target == "local"
    d = router.decide(req("x" * 50))
    assert (d.target, d.rule) == ("cloud", "text_length") and "50 characters" in d.reason
    router, _, _ = make(espeak, cloud_min_chars=0, cloud_min_tokens=5)
    assert count_tokens("one, two three.") == 5
    assert router.decide(req("one two three")).target == "local"
    assert router.decide(req("one, two three.")).rule == "text_length"
    router, _, _ = make(espeak, cloud_min_chars=0, cloud_min_tokens=0)
    assert router.decide(req("x" * 5000)).target == "local"


def test_cloud_modes_and_voices(espeak: EspeakSynthesizer) -> None:
    voice = espeak.voices()[0]
    router, engines, _ = make(espeak, cloud_voices=(voice,))
    prompt = PromptAudio(pcm=__import__("numpy").zeros(1600, "float32"), sample_rate=16000, text="hi")
    d = router.decide(req(mode="zero_shot", prompt=prompt))
    # espeak serves sft only: the capability rule comes first
    assert (d.target, d.rule) == ("cloud", "local_lacks") and "zero_shot" in d.reason
    assert router.decide(req(voice=voice)).rule == "voice"
    assert router.decide(req(voice="a-cloud-only-voice")).rule == "local_lacks"
    # cloud down: a preference falls back to local, a capability gap is an error
    engines.slots["cloud"].swap(Unreachable())
    assert router.decide(req(voice=voice)).target == "local"
    with pytest.raises(ApiError) as err:
        router.decide(req(mode="zero_shot", prompt=prompt))
    assert err.value.code == "cloud_unavailable" and "zero_shot" in err.value.message
    # no cloud configured at all: the local engine answers (with its own error)
    engines.slots["cloud"].swap(None)
    assert router.decide(req(mode="zero_shot", prompt=prompt)).target == "local"


def test_mode_preference_when_local_serves_it(espeak: EspeakSynthesizer) -> None:
    router, _, _ = make(espeak, cloud_modes=("sft",))
    d = router.decide(req())
    assert (d.target, d.rule) == ("cloud", "mode")


def test_queue_depth_and_deadline(espeak: EspeakSynthesizer) -> None:
    router, _, clock = make(espeak, cloud_queue_depth=3, load=(3, 0.0))
    assert router.decide(req()).rule == "queue_depth"
    router, _, clock = make(espeak, load=(1, 2.0), deadline_margin_ms=500)
    assert router.decide(req(deadline_ms=5000, received_at=clock.now)).target == "local"
    clock.now += 2.6  # 2.4 s left < 2.0 s wait + 0.5 s margin
    d = router.decide(req(deadline_ms=5000, received_at=1000.0))
    assert (d.target, d.rule) == ("cloud", "deadline") and "2500 ms" in d.reason
    assert router.decide(req(received_at=1000.0)).target == "local"  # no deadline: no rule


def test_engine_health_and_link(espeak: EspeakSynthesizer) -> None:
    router, engines, _ = make(espeak)
    engines.slots["local"].swap(None)
    engines.slots["local"].set_state("loading")
    d = router.decide(req())
    assert (d.target, d.rule) == ("cloud", "local_unavailable") and "loading" in d.reason
    link = Unreachable()
    engines.slots["cloud"].swap(link)
    assert router.decide(req()).target == "fallback"  # cloud unreachable too
    assert engines.slots["cloud"].describe()["state"] == "unreachable"
    link.up = True
    assert router.decide(req()).target == "cloud"
    with pytest.raises(ApiError):
        engines.slots["cloud"].swap(Unreachable())
        router.decide(req(route="cloud"))


def test_after_failure_both_ways(espeak: EspeakSynthesizer) -> None:
    router, engines, _ = make(espeak)
    cloud = RouteDecision("cloud", "x")
    local = RouteDecision("local", "x")
    r = req()
    d = router.after_failure(cloud, "timeout", False, r, {"cloud"})
    assert d is not None and (d.target, d.rule) == ("local", "cloud_failed") and "timeout" in d.reason
    d = router.after_failure(local, "boom", False, r, {"local"})
    assert d is not None and (d.target, d.rule) == ("cloud", "local_failed")
    # both tried: the fallback voice; audio already out: nothing
    d = router.after_failure(cloud, "timeout", False, r, {"local", "cloud"})
    assert d is not None and d.target == "fallback"
    assert router.after_failure(cloud, "timeout", True, r, {"cloud"}) is None
    # route=local never moves to the cloud
    d = router.after_failure(local, "boom", False, req(route="local"), {"local"})
    assert d is not None and d.target == "fallback"
    # a request only the cloud can serve: no local, no fallback voice
    engines.slots["cloud"].swap(espeak)
    zs = req(mode="instruct", instruct_text="happy")
    assert router.after_failure(cloud, "timeout", False, zs, {"cloud"}) is None
    # cloud failed and the local engine is down: the fallback voice for plain text
    engines.slots["local"].swap(None)
    d = router.after_failure(cloud, "timeout", False, r, {"cloud"})
    assert d is not None and (d.target, d.rule) == ("fallback", "cloud_failed")
