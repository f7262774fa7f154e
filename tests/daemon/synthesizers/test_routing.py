from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from cosyedge_daemon.request.errors import ApiError
from cosyedge_daemon.request.request import TtsRequest
from cosyedge_daemon.settings.schema import RoutingSettings
from cosyedge_daemon.synthesizers.espeak import EspeakSynthesizer
from cosyedge_daemon.synthesizers.routing import RouteDecision, Router, SynthesizerSet
from cosyedge_models.synthesis.api import AudioChunk, SynthesisRequest

from tests.support.components import require_binary


@pytest.fixture()
def espeak() -> EspeakSynthesizer:
    require_binary("espeak-ng", "apt-get install espeak-ng")
    return EspeakSynthesizer()


class Tracked(EspeakSynthesizer):
    """A real espeak-ng engine that records when it is closed."""

    closed = False

    def close(self) -> None:
        self.closed = True

    def synthesize(
        self, request: SynthesisRequest, cancel: threading.Event | None = None
    ) -> Iterator[AudioChunk]:
        yield from super().synthesize(request, cancel)


def req(route: str = "auto") -> TtsRequest:
    return TtsRequest(id="r", text="hello", route=route)  # type: ignore[arg-type]


def test_local_when_ready_else_fallback_else_error(espeak: EspeakSynthesizer) -> None:
    engines = SynthesizerSet(RoutingSettings())
    router = Router(engines, RoutingSettings())
    engines.slots["local"].swap(espeak)
    engines.slots["fallback"].swap(espeak)
    assert router.decide(req()) == RouteDecision("local", "local engine ready")
    assert router.decide(req("local")) == RouteDecision("local", "requested")
    engines.slots["local"].swap(None)
    engines.slots["local"].set_state("failed", "bundle missing")
    d = router.decide(req())
    assert d.target == "fallback" and "bundle missing" in d.reason
    engines.slots["fallback"].swap(None)
    with pytest.raises(ApiError) as err:
        router.decide(req())
    assert err.value.code == "synthesizer_unavailable"


def test_cloud_without_cloud_engine(espeak: EspeakSynthesizer) -> None:
    engines = SynthesizerSet(RoutingSettings())
    engines.slots["local"].swap(espeak)
    with pytest.raises(ApiError) as err:
        Router(engines, RoutingSettings()).decide(req("cloud"))
    assert err.value.code == "cloud_unavailable"


def test_unhealthy_after_failures_then_retried(espeak: EspeakSynthesizer) -> None:
    now = [0.0]
    settings = RoutingSettings(max_consecutive_failures=2, unhealthy_retry_s=10)
    engines = SynthesizerSet(settings)
    slot = engines.slots["local"]
    slot._clock = lambda: now[0]  # deterministic time
    slot.swap(espeak)
    engines.slots["fallback"].swap(espeak)
    router = Router(engines, settings)
    slot.report(False)
    assert router.decide(req()).target == "local"
    slot.report(False)
    d = router.decide(req())
    assert d.target == "fallback" and "unhealthy" in d.reason
    now[0] = 11.0
    assert router.decide(req()).target == "local"
    slot.report(True)
    assert slot.failures == 0


def test_after_failure_rules(espeak: EspeakSynthesizer) -> None:
    engines = SynthesizerSet(RoutingSettings())
    engines.slots["fallback"].swap(espeak)
    router = Router(engines, RoutingSettings())
    local = RouteDecision("local", "x")
    nxt = router.after_failure(local, "boom", audio_out=False)
    assert nxt is not None and nxt.target == "fallback" and "boom" in nxt.reason
    assert router.after_failure(local, "boom", audio_out=True) is None
    assert router.after_failure(RouteDecision("fallback", "x"), "boom", audio_out=False) is None
    router.settings = RoutingSettings(fallback_on_error=False)
    assert router.after_failure(local, "boom", audio_out=False) is None


def test_swap_closes_old_engine_after_its_last_lease() -> None:
    old, new = Tracked(), Tracked()
    engines = SynthesizerSet(RoutingSettings())
    slot = engines.slots["local"]
    slot.swap(old)
    with engines.lease("local") as leased:
        assert leased is old
        slot.swap(new)  # a reload while a request runs on the old engine
        assert not old.closed
        with engines.lease("local") as second:
            assert second is new
    assert old.closed and not new.closed
    slot.swap(None)
    assert new.closed
    with pytest.raises(ApiError), engines.lease("local"):
        pass


def test_a_pause_waits_for_running_leases_and_holds_new_ones() -> None:
    """What a GPU reload does (docs/gpu.md): new leases wait until the block ends, and
    the block starts only once the running ones have ended."""
    old, new = Tracked(), Tracked()
    engines = SynthesizerSet(RoutingSettings())
    slot = engines.slots["local"]
    slot.swap(old)
    events: list[str] = []
    running = threading.Event()
    finish = threading.Event()

    def request() -> None:
        with engines.lease("local") as e:
            assert e is old
            running.set()
            finish.wait(5)
            events.append("old request done")

    def reload() -> None:
        with slot.paused(5) as drained:
            events.append(f"paused, drained={drained}")
            time.sleep(0.2)  # the new engine loads
            slot.swap(new)
            events.append("swapped")

    def late() -> None:
        with engines.lease("local") as e:
            events.append("late request on " + ("new" if e is new else "old"))

    first = threading.Thread(target=request)
    first.start()
    assert running.wait(5)
    pauser = threading.Thread(target=reload)
    pauser.start()
    time.sleep(0.1)
    waiter = threading.Thread(target=late)
    waiter.start()
    time.sleep(0.1)
    assert events == []  # the pause waits for the old request; the late one waits for the pause
    finish.set()
    for t in (first, pauser, waiter):
        t.join(5)
    assert events == ["old request done", "paused, drained=True", "swapped", "late request on new"]
    assert old.closed and not new.closed


def test_a_pause_gives_up_waiting_after_its_timeout() -> None:
    engines = SynthesizerSet(RoutingSettings())
    slot = engines.slots["local"]
    slot.swap(Tracked())
    with engines.lease("local"):
        t0 = time.monotonic()
        with slot.paused(0.2) as drained:
            assert not drained and time.monotonic() - t0 >= 0.2
    with engines.lease("local") as e:  # not paused any more
        assert e is not None
