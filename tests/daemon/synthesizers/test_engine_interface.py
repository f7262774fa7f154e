"""The typed interface the daemon asks of an engine (cosyedge_models.synthesis.api.ServedSynthesizer):
the neutral defaults, and the router reading `available` without probing."""

from __future__ import annotations

from cosyedge_daemon.settings.schema import RoutingSettings
from cosyedge_daemon.synthesizers.cloud import describe_link
from cosyedge_daemon.synthesizers.routing import SynthesizerSlot
from cosyedge_models.synthesis.api import ServedSynthesizer, SynthesisRequest

from tests.support.fake_synthesizer import FakeSynthesizer


class _Away(FakeSynthesizer):
    def available(self) -> bool:
        return False


def test_defaults_of_an_engine_with_nothing_more_to_say() -> None:
    engine: ServedSynthesizer = FakeSynthesizer(chunks=2)
    assert engine.available()
    engine.set_load_level("degraded")  # accepted, ignored
    synth = engine.for_job("job-1", None)
    chunks = list(synth(SynthesisRequest(text="hi")))
    assert [c.index for c in chunks] == [0, 1] and chunks[-1].last


def test_router_slot_uses_available() -> None:
    slot = SynthesizerSlot("cloud", RoutingSettings())
    slot.swap(FakeSynthesizer())
    assert slot.healthy and slot.describe()["state"] == "ready"
    slot.swap(_Away())
    assert not slot.healthy and slot.describe() == {
        "state": "unreachable", "engine": "fake", "error": None, "failures": 0}
    assert describe_link(None) == "unknown"
