"""A request's route is decided once, when it is accepted, and it is validated
once, by the engine chosen; the pipeline runs the job on that route and moves
on only the way it does after an engine failure. Each job gets exactly one
answer either way."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from cosyedge_daemon.request.errors import ApiError
from cosyedge_daemon.request.request import TtsRequest
from cosyedge_daemon.serving.jobs import Job
from cosyedge_daemon.settings.schema import RoutingSettings
from cosyedge_daemon.synthesizers.routing import RouteDecision, Router, SynthesizerSet
from cosyedge_models.errors import RequestError
from cosyedge_models.synthesis.api import AudioChunk, SynthesisRequest, SynthesizeFn

from tests.daemon.serving.test_pipeline_workers import Answers, make
from tests.support.fake_synthesizer import FakeSynthesizer


class Counting(FakeSynthesizer):
    """Counts validations; rejects texts that contain `rejects`."""

    def __init__(self, name: str = "fake", rejects: str = "NOPE", **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.name = name
        self.rejects = rejects
        self.validations = 0

    def validate(self, request: SynthesisRequest) -> None:
        self.validations += 1
        if self.rejects and self.rejects in request.text:
            raise RequestError("voice_unsuitable", "this engine cannot say NOPE")


def _router(local: Counting, cloud: Counting | None = None) -> Router:
    engines = SynthesizerSet(RoutingSettings())
    engines.slots["local"].swap(local)
    engines.slots["cloud"].swap(cloud)
    return Router(engines, RoutingSettings())


def test_auto_validates_once_on_the_chosen_engine() -> None:
    local, cloud = Counting(), Counting("cloudy", rejects="")
    router = _router(local, cloud)
    decision = router.admit(TtsRequest(id="a", text="hello"))
    assert decision.target == "local" and (local.validations, cloud.validations) == (1, 0)
    # what the local engine rejects goes to the cloud, validated there (once each)
    moved = router.admit(TtsRequest(id="b", text="NOPE please"))
    assert (moved.target, moved.rule) == ("cloud", "local_lacks") and "cannot say NOPE" in moved.reason
    assert (local.validations, cloud.validations) == (2, 1)


def test_rejection_without_a_cloud_is_the_engines_error() -> None:
    local = Counting()
    router = _router(local)
    with pytest.raises(ApiError) as err:
        router.admit(TtsRequest(id="c", text="NOPE"))
    assert err.value.code == "voice_unsuitable" and local.validations == 1
    router.synthesizers.slots["cloud"].swap(_Down())
    with pytest.raises(ApiError) as err:
        router.admit(TtsRequest(id="d", text="NOPE"))
    assert err.value.code == "cloud_unavailable" and "cannot say NOPE" in err.value.message


class _Down(FakeSynthesizer):
    def available(self) -> bool:
        return False


def test_pipeline_runs_the_admitted_route_without_deciding_again() -> None:
    local, fallback = Counting(chunks=1), Counting("fallback-fake", chunks=1)
    p = make(local, workers=1)
    p.router.synthesizers.slots["fallback"].swap(fallback)

    def no_second_decision(_request: TtsRequest) -> RouteDecision:
        raise AssertionError("the route was decided again")

    p.router.decide = no_second_decision  # type: ignore[method-assign]
    rec = Answers()
    p.start()
    try:
        job = Job(TtsRequest(id="j1", text="hello", output="publish", received_at=time.monotonic()), rec)
        job.decision = RouteDecision("fallback", "chosen at intake", "local_unavailable")
        p.scheduler.submit(job)
        # the local engine went away while this one waited: on as after a failure (to the fallback)
        gone = Job(TtsRequest(id="j2", text="hello", output="publish", received_at=time.monotonic()), rec)
        gone.decision = RouteDecision("local", "chosen at intake", "default")
        for _ in range(RoutingSettings().max_consecutive_failures):
            p.router.synthesizers.slots["local"].report(False)
        p.scheduler.submit(gone)
        rec.wait(2)
    finally:
        p.stop()
    assert rec.answers == {"j1": ("done", "completed"), "j2": ("done", "completed")}
    assert rec.order.count("j1") == 1 and rec.order.count("j2") == 1  # one answer each
    assert (job.route, job.engine_name) == ("fallback", "fallback-fake")
    assert (gone.route, gone.route_rule) == ("fallback", "local_failed")
    assert fallback.started == ["hello", "hello"]
    assert local.started == [] and (local.validations, fallback.validations) == (0, 0)


class _Recording(Counting):
    """Records what the pipeline says of each run: whether the request was validated already, and which."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)
        self.runs: list[tuple[bool, SynthesisRequest]] = []

    def for_job(self, job_id: str, deadline_at: float | None, *, validated: bool = False) -> SynthesizeFn:
        def run(request: SynthesisRequest, cancel: threading.Event | None = None) -> Iterator[AudioChunk]:
            self.runs.append((validated, request))
            if not validated:  # as the CosyVoice synthesizer does: validate, unless told it was
                self.validate(request)
            return self.synthesize(request, cancel)

        return run


def test_the_admitted_request_is_validated_once_and_run_as_built() -> None:
    local = _Recording(chunks=1)
    p = make(local, workers=1)
    rec = Answers()
    p.start()
    try:
        job = Job(TtsRequest(id="v1", text="hello", output="publish", received_at=time.monotonic()), rec)
        job.decision = p.router.admit(job.request)
        p.scheduler.submit(job)
        rec.wait(1)
        # a synthesizer swapped in after admission (a reload) validates for itself
        newer = _Recording(chunks=1)
        stale = Job(TtsRequest(id="v2", text="hello", output="publish", received_at=time.monotonic()), rec)
        stale.decision = p.router.admit(stale.request)
        p.router.synthesizers.slots["local"].swap(newer)
        p.scheduler.submit(stale)
        rec.wait(2)
    finally:
        p.stop()
    assert rec.answers == {"v1": ("done", "completed"), "v2": ("done", "completed")}
    assert local.validations == 2 and [v for v, _ in local.runs] == [True]
    assert job.decision is not None and local.runs[0][1] is job.decision.request  # built once
    assert newer.validations == 1 and [v for v, _ in newer.runs] == [False]
