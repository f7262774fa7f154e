"""The one way in (serving/admission.py), as every front end uses it: an
admitted request is answered once by the pipeline; a refused one gets its
one error through the Completer (counted); a repeated client id gets the
first answer again; a cancel of a queued request is answered at once."""

from __future__ import annotations

import threading

from cosyedge_daemon.request.builder import build_request
from cosyedge_daemon.serving.admission import Admission
from cosyedge_daemon.serving.answer import Completer
from cosyedge_daemon.serving.metrics import Metrics
from cosyedge_daemon.settings.loader import settings_from_mapping

from tests.daemon.serving.test_pipeline_workers import Answers, make
from tests.support.fake_synthesizer import FakeSynthesizer


def _admission(**sched: object) -> tuple[Admission, Metrics]:
    p = make(FakeSynthesizer(chunks=1), workers=1, **sched)  # type: ignore[arg-type]
    metrics = Metrics()
    p.completer = Completer(p.scheduler, metrics, False)
    return Admission(settings_from_mapping({"device_id": "t"}), p.scheduler, p), metrics


def test_admitted_refused_and_repeated_requests_are_answered_once_each() -> None:
    admission, metrics = _admission()
    rec = Answers()
    admission.pipeline.start()
    try:
        ok = admission.admit(build_request(admission.limits, "Hello.", request_id="a1", output="publish"), rec)
        assert ok is not None
        rec.wait(1)
        # no speaker: output play is refused, answered by admission (not by the caller)
        refused = admission.admit(build_request(admission.limits, "Hi.", request_id="a2", output="play"), rec)
        assert refused is None and rec.answers["a2"] == ("error", "no_audio_device")
        # the same client id again: the first answer, replayed, not spoken twice
        again = admission.admit(build_request(admission.limits, "Hello.", request_id="a1", output="publish"), rec)
        assert again is None  # answered synchronously, before admit returns
    finally:
        admission.pipeline.stop()
    assert rec.order == ["a1", "a2", "a1"] and rec.answers["a1"] == ("done", "completed")
    assert admission.pipeline.router.synthesizers.slots["local"].engine.started == ["Hello."]  # type: ignore[union-attr]
    assert metrics.rejected.labels(code="no_audio_device")._value.get() == 1


def test_a_queued_request_cancelled_is_answered_at_once() -> None:
    admission, _ = _admission()
    rec = Answers()
    # the pipeline is not started: the job stays queued
    job = admission.admit(build_request(admission.limits, "Wait.", request_id="q1", output="publish"), rec)
    assert job is not None and not job.finished
    admission.cancel("q1")
    assert rec.answers == {"q1": ("error", "cancelled")} and job.finished
    admission.cancel("q1")  # gone: ignored, no second answer
    assert rec.order == ["q1"]


def test_close_answers_the_queued_and_refuses_new_ones() -> None:
    admission, _ = _admission()
    rec = Answers()
    admission.admit(build_request(admission.limits, "One.", request_id="c1", output="publish"), rec)
    admission.close()
    assert rec.answers == {"c1": ("error", "shutting_down")}
    assert admission.admit(build_request(admission.limits, "Two.", request_id="c2", output="publish"), rec) is None
    assert rec.answers["c2"] == ("error", "shutting_down")
    done = threading.Event()
    threading.Thread(target=lambda: (admission.drain(1.0), done.set())).start()
    assert done.wait(10)
