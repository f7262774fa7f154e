"""Where a request is synthesized. One engine per target ('local', 'cloud',
'fallback') in an SynthesizerSet; the Router picks a target by trying its rules
in order (explicit cloud, the route=auto rules, local/fallback), and says
what to try after a failure (cloud -> local, local -> cloud, either -> the
fallback voice). Pure logic: the synthesizers, the clock and the local load
come in from outside, so the rules are tested alone."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Literal

from cosyedge_daemon.request.errors import SYNTHESIZER_UNAVAILABLE, ApiError
from cosyedge_daemon.request.request import TtsRequest
from cosyedge_daemon.settings.schema import RoutingSettings
from cosyedge_models.errors import RequestError
from cosyedge_models.synthesis.api import ServedSynthesizer, SynthesisRequest

log = logging.getLogger(__name__)

Target = Literal["local", "cloud", "fallback"]
TARGETS: tuple[Target, ...] = ("local", "cloud", "fallback")


@dataclass(frozen=True)
class RouteDecision:
    target: Target
    reason: str  # for people: done.route_reason
    rule: str = field(default="default", compare=False)  # a stable label for the metrics
    # The synthesizer's request for this target, built once and validated by `validated_by`
    # (the synthesizer instance then loaded): the pipeline runs it without validating again.
    request: SynthesisRequest | None = field(default=None, compare=False)
    validated_by: object | None = field(default=None, compare=False, repr=False)


class SynthesizerSlot:
    """One target's engine: swapped without dropping requests (the old one is
    closed when its last lease ends), and its health from recent failures."""

    def __init__(self, name: Target, settings: RoutingSettings, clock: Callable[[], float] = time.monotonic):
        self.name = name
        self.settings = settings
        self._clock = clock
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # leases released; a pause ended
        self._paused = False
        self._engine: ServedSynthesizer | None = None
        self._leases: dict[int, int] = {}
        self.state = "absent"  # absent | loading | ready | failed
        self.error = ""
        self.failures = 0
        self._unhealthy_since: float | None = None

    @property
    def engine(self) -> ServedSynthesizer | None:
        return self._engine

    def set_state(self, state: str, error: str = "") -> None:
        self.state, self.error = state, error

    def swap(self, engine: ServedSynthesizer | None) -> None:
        with self._lock:
            old, self._engine = self._engine, engine
            self.failures, self._unhealthy_since = 0, None
            close_now = old is not None and old is not engine and self._leases.get(id(old), 0) == 0
            self.state = "ready" if engine is not None else "absent"
        if close_now and old is not None:
            _close(old)

    @contextmanager
    def paused(self, drain_timeout_s: float) -> Iterator[bool]:
        """New leases wait while the block runs; it starts once every current lease
        has ended (True), or after `drain_timeout_s` (False: some still run). For a
        reload whose new engine captures CUDA graphs at load: in CUDA's global
        capture mode any other GPU work of the process spoils the capture (docs/gpu.md)."""
        with self._cond:
            self._paused = True
            drained = self._cond.wait_for(lambda: not self._leases, timeout=drain_timeout_s)
        try:
            yield drained
        finally:
            with self._cond:
                self._paused = False
                self._cond.notify_all()

    def acquire(self) -> ServedSynthesizer | None:
        with self._cond:
            self._cond.wait_for(lambda: not self._paused)
            engine = self._engine
            if engine is not None:
                self._leases[id(engine)] = self._leases.get(id(engine), 0) + 1
            return engine

    def release(self, engine: ServedSynthesizer) -> None:
        with self._lock:
            left = self._leases.get(id(engine), 1) - 1
            if left:
                self._leases[id(engine)] = left
            else:
                self._leases.pop(id(engine), None)
                self._cond.notify_all()  # a pause may be waiting for the last lease
            close_now = left == 0 and engine is not self._engine
        if close_now:
            _close(engine)

    @property
    def healthy(self) -> bool:
        """Loaded, reachable (an engine may say it is not: the cloud's link)
        and not failing; an unhealthy engine gets a retry after
        `unhealthy_retry_s`."""
        if self._engine is None:
            return False
        if not self._engine.available():
            return False
        if self._unhealthy_since is None:
            return True
        return self._clock() - self._unhealthy_since >= self.settings.unhealthy_retry_s

    def report(self, ok: bool) -> None:
        with self._lock:
            if ok:
                self.failures, self._unhealthy_since = 0, None
                return
            self.failures += 1
            if self.failures >= self.settings.max_consecutive_failures:
                self._unhealthy_since = self._clock()

    def describe(self) -> dict[str, object]:
        engine = self._engine
        state = self.state
        if engine is not None and not self.healthy:
            state = "unhealthy"
            if not engine.available():
                state = "unreachable"
        return {
            "state": state,
            "engine": None if engine is None else engine.name,
            "error": self.error or None,
            "failures": self.failures,
        }


def _close(engine: ServedSynthesizer) -> None:
    try:
        engine.close()
    except Exception:
        log.exception("closing engine %s failed", engine.name)


class SynthesizerSet:
    def __init__(self, settings: RoutingSettings) -> None:
        self.slots = {t: SynthesizerSlot(t, settings) for t in TARGETS}

    def reconfigure(self, settings: RoutingSettings) -> None:
        for slot in self.slots.values():
            slot.settings = settings

    def available(self, target: Target) -> bool:
        return self.slots[target].healthy

    @contextmanager
    def lease(self, target: Target) -> Iterator[ServedSynthesizer]:
        slot = self.slots[target]
        engine = slot.acquire()
        if engine is None:
            raise ApiError(SYNTHESIZER_UNAVAILABLE, f"no {target} engine is loaded")
        try:
            yield engine
        finally:
            slot.release(engine)

    def served_voices(self) -> tuple[str, list[str]]:
        """(engine name, its voices) of the local engine (or the fallback while it is missing),
        for the front ends' voice listings."""
        for target in ("local", "fallback"):
            engine = self.slots[target].engine  # type: ignore[index]
            if engine is not None:
                return engine.name, engine.voices()
        return "none", []

    def close(self) -> None:
        for slot in self.slots.values():
            slot.swap(None)


Rule = Callable[[TtsRequest, SynthesizerSet], "RouteDecision | None"]
LoadProbe = Callable[[TtsRequest], tuple[int, float]]  # (requests waiting, estimated local wait in s)

_TOKEN_RE = re.compile(r"\w+|[^\w\s]")


def count_tokens(text: str) -> int:
    """Words and punctuation marks: a tokenizer-free stand-in for the LLM's text tokens."""
    return len(_TOKEN_RE.findall(text))


def cloud_rule(request: TtsRequest, synthesizers: SynthesizerSet) -> RouteDecision | None:
    """route=cloud: the cloud engine or an error."""
    if request.route != "cloud":
        return None
    if synthesizers.available("cloud"):
        return RouteDecision("cloud", "requested", "requested")
    raise ApiError(
        "cloud_unavailable",
        "route 'cloud' was requested but no cloud engine is configured or it is unavailable",
        request.id,
    )


def local_rule(request: TtsRequest, synthesizers: SynthesizerSet) -> RouteDecision | None:
    """route=local/auto: the local engine when loaded and healthy, else the fallback voice."""
    if request.route not in ("local", "auto"):
        return None
    if synthesizers.available("local"):
        if request.route == "local":
            return RouteDecision("local", "requested", "requested")
        return RouteDecision("local", "local engine ready", "default")
    why = local_down_reason(synthesizers)
    if synthesizers.available("fallback"):
        return RouteDecision("fallback", why, "local_unavailable")
    raise ApiError(SYNTHESIZER_UNAVAILABLE, f"{why}, and the fallback voice is off or missing", request.id)


def local_down_reason(synthesizers: SynthesizerSet) -> str:
    slot = synthesizers.slots["local"]
    if slot.engine is not None and not slot.healthy:
        return f"local engine is unhealthy ({slot.failures} failures)"
    return {
        "loading": "local engine is loading",
        "failed": f"local engine failed to load: {slot.error}",
        "absent": "no local engine",
    }.get(slot.state, "local engine is unhealthy")


def local_lacks(request: TtsRequest, synthesizers: SynthesizerSet) -> str | None:
    """Why the loaded local synthesizer cannot serve the request (its modes and
    voices); None: it can, or none is loaded to ask. Its own validation is
    `Router.validated`, run once, on the synthesizer chosen."""
    engine = synthesizers.slots["local"].engine
    if engine is None:
        return None
    if request.mode not in engine.modes():
        return f"the local engine does not serve mode '{request.mode}'"
    voices = engine.voices()
    if request.voice and voices and request.voice not in voices:
        return f"the local engine has no voice '{request.voice}'"
    return None


@dataclass
class Router:
    """Rules in order; the first that decides wins. With route=auto the cloud
    gets what the local engine cannot or should not serve (when it is up)."""

    synthesizers: SynthesizerSet
    settings: RoutingSettings
    load: LoadProbe | None = None
    clock: Callable[[], float] = time.monotonic
    rules: list[Rule] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.rules:
            self.rules = [cloud_rule, self.auto_rule, local_rule]

    def admit(self, request: TtsRequest) -> RouteDecision:
        """The route of a new request, decided once (the pipeline runs the job
        there and moves on only through `after_failure`), with the request
        validated once, by the synthesizer chosen. route=auto: what the local
        synthesizer rejects goes to the cloud when it is up."""
        decision = self.decide(request)
        try:
            return self.validated(decision, request)
        except RequestError as exc:
            if decision.target != "local" or request.route != "auto":
                raise ApiError(exc.code, str(exc), request.id) from None
            cloud = self._local_cannot_serve(request, f"the local engine cannot serve it: {exc}")
            if cloud is None:
                raise ApiError(exc.code, str(exc), request.id) from None
            try:
                return self.validated(cloud, request)
            except RequestError as cloud_exc:
                raise ApiError(cloud_exc.code, str(cloud_exc), request.id) from None

    def validated(self, decision: RouteDecision, request: TtsRequest) -> RouteDecision:
        """`decision` with the synthesizer's request built and validated by the
        target's synthesizer (RequestError when it refuses)."""
        synthesis = request.synthesis_request(fallback=decision.target == "fallback")
        with self.synthesizers.lease(decision.target) as engine:
            engine.validate(synthesis)
        return replace(decision, request=synthesis, validated_by=engine)

    def _local_cannot_serve(self, request: TtsRequest, lacks: str) -> RouteDecision | None:
        """route=auto and the local synthesizer cannot serve the request: the
        cloud when it is up; cloud_unavailable when it is configured but down;
        None without a cloud (the local synthesizer answers with its own error)."""
        if self.synthesizers.available("cloud"):
            return RouteDecision("cloud", lacks, "local_lacks")
        if self.synthesizers.slots["cloud"].engine is not None:
            raise ApiError("cloud_unavailable", f"{lacks}, and the cloud is unavailable", request.id)
        return None

    def decide(self, request: TtsRequest) -> RouteDecision:
        """The target by the rules alone (no engine validation: see `admit`)."""
        for rule in self.rules:
            decision = rule(request, self.synthesizers)
            if decision is not None:
                return decision
        raise ApiError(SYNTHESIZER_UNAVAILABLE, f"no route serves route={request.route!r}", request.id)

    def auto_rule(self, request: TtsRequest, synthesizers: SynthesizerSet) -> RouteDecision | None:
        """route=auto: the cloud when a rule says so and it is up; None: local_rule decides."""
        if request.route != "auto":
            return None
        s = self.settings
        cloud_up = synthesizers.available("cloud")
        lacks = local_lacks(request, synthesizers)
        if lacks is not None:
            return self._local_cannot_serve(request, lacks)
        if not cloud_up:
            return None
        if not synthesizers.available("local"):
            return RouteDecision("cloud", local_down_reason(synthesizers), "local_unavailable")
        if request.mode in s.cloud_modes:
            return RouteDecision("cloud", f"mode '{request.mode}' goes to the cloud", "mode")
        if request.voice and request.voice in s.cloud_voices:
            return RouteDecision("cloud", f"voice '{request.voice}' goes to the cloud", "voice")
        chars = len(request.text)
        if s.cloud_min_chars and chars >= s.cloud_min_chars:
            return RouteDecision("cloud", f"text of {chars} characters (>= {s.cloud_min_chars})", "text_length")
        if s.cloud_min_tokens:
            tokens = count_tokens(request.text)
            if tokens >= s.cloud_min_tokens:
                return RouteDecision("cloud", f"text of {tokens} tokens (>= {s.cloud_min_tokens})", "text_length")
        return self._load_rule(request)

    def _load_rule(self, request: TtsRequest) -> RouteDecision | None:
        if self.load is None:
            return None
        s = self.settings
        depth, wait_s = self.load(request)
        if s.cloud_queue_depth and depth >= s.cloud_queue_depth:
            return RouteDecision(
                "cloud", f"{depth} requests wait locally (>= {s.cloud_queue_depth})", "queue_depth"
            )
        if request.deadline_ms:
            left_s = request.received_at + request.deadline_ms / 1000.0 - self.clock()
            need_s = wait_s + s.deadline_margin_ms / 1000.0
            if need_s > left_s:
                return RouteDecision(
                    "cloud",
                    f"estimated local wait {need_s * 1000:.0f} ms exceeds the {max(left_s, 0) * 1000:.0f} ms "
                    "left to the deadline",
                    "deadline",
                )
        return None

    def after_failure(
        self,
        failed: RouteDecision,
        error: str,
        audio_out: bool,
        request: TtsRequest | None = None,
        tried: Collection[str] = (),
    ) -> RouteDecision | None:
        """What to try after `failed` raised; None: give up (error to the client).
        Nothing is retried after audio went out (it would be spoken twice)."""
        if audio_out or failed.target == "fallback":
            return None
        synthesizers = self.synthesizers
        if failed.target == "cloud" and request is not None:
            if "local" not in tried and synthesizers.available("local") and local_lacks(request, synthesizers) is None:
                try:
                    return self.validated(RouteDecision("local", f"cloud failed: {error}", "cloud_failed"), request)
                except (RequestError, ApiError):
                    pass  # the local synthesizer cannot serve it (or went away): on to the fallback rule
            if request.mode != "sft":  # the fallback voice would ignore what was asked for
                return None
        if (
            failed.target == "local"
            and request is not None
            and request.route == "auto"
            and "cloud" not in tried
            and synthesizers.available("cloud")
        ):
            return RouteDecision("cloud", f"local engine failed: {error}", "local_failed")
        if self.settings.fallback_on_error and synthesizers.available("fallback"):
            return RouteDecision("fallback", f"{failed.target} engine failed: {error}", f"{failed.target}_failed")
        return None
