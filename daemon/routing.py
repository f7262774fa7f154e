"""Where a request is synthesized. One Engine per target ('local', 'cloud',
'fallback') in an EngineSet; the Router picks a target by trying its rules
in order, and says what to try after a failure. The dispatcher only asks.
The cloud side adds its Engine under 'cloud' and its rules to
`Router.rules` (before `local_rules`), nothing else changes."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from daemon.settings import RoutingSettings
from daemon.tts_api import ApiError, TtsRequest
from models.api import Engine

log = logging.getLogger(__name__)

Target = Literal["local", "cloud", "fallback"]
TARGETS: tuple[Target, ...] = ("local", "cloud", "fallback")


@dataclass(frozen=True)
class RouteDecision:
    target: Target
    reason: str


class EngineSlot:
    """One target's engine: swapped without dropping requests (the old one is
    closed when its last lease ends), and its health from recent failures."""

    def __init__(self, name: Target, settings: RoutingSettings, clock: Callable[[], float] = time.monotonic):
        self.name = name
        self.settings = settings
        self._clock = clock
        self._lock = threading.Lock()
        self._engine: Engine | None = None
        self._leases: dict[int, int] = {}
        self.state = "absent"  # absent | loading | ready | failed
        self.error = ""
        self.failures = 0
        self._unhealthy_since: float | None = None

    @property
    def engine(self) -> Engine | None:
        return self._engine

    def set_state(self, state: str, error: str = "") -> None:
        self.state, self.error = state, error

    def swap(self, engine: Engine | None) -> None:
        with self._lock:
            old, self._engine = self._engine, engine
            self.failures, self._unhealthy_since = 0, None
            close_now = old is not None and old is not engine and self._leases.get(id(old), 0) == 0
            self.state = "ready" if engine is not None else "absent"
        if close_now and old is not None:
            _close(old)

    def acquire(self) -> Engine | None:
        with self._lock:
            engine = self._engine
            if engine is not None:
                self._leases[id(engine)] = self._leases.get(id(engine), 0) + 1
            return engine

    def release(self, engine: Engine) -> None:
        with self._lock:
            left = self._leases.get(id(engine), 1) - 1
            if left:
                self._leases[id(engine)] = left
            else:
                self._leases.pop(id(engine), None)
            close_now = left == 0 and engine is not self._engine
        if close_now:
            _close(engine)

    @property
    def healthy(self) -> bool:
        """Loaded and not failing; an unhealthy engine gets a retry after
        `unhealthy_retry_s`."""
        if self._engine is None:
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
        return {
            "state": state,
            "engine": getattr(engine, "name", None),
            "error": self.error or None,
            "failures": self.failures,
        }


def _close(engine: Engine) -> None:
    try:
        engine.close()
    except Exception:
        log.exception("closing engine %s failed", getattr(engine, "name", engine))


class EngineSet:
    def __init__(self, settings: RoutingSettings) -> None:
        self.slots = {t: EngineSlot(t, settings) for t in TARGETS}

    def reconfigure(self, settings: RoutingSettings) -> None:
        for slot in self.slots.values():
            slot.settings = settings

    def available(self, target: Target) -> bool:
        return self.slots[target].healthy

    @contextmanager
    def lease(self, target: Target) -> Iterator[Engine]:
        slot = self.slots[target]
        engine = slot.acquire()
        if engine is None:
            raise ApiError("engine_unavailable", f"no {target} engine is loaded")
        try:
            yield engine
        finally:
            slot.release(engine)

    def close(self) -> None:
        for slot in self.slots.values():
            slot.swap(None)


Rule = Callable[[TtsRequest, EngineSet], "RouteDecision | None"]


def cloud_rule(request: TtsRequest, engines: EngineSet) -> RouteDecision | None:
    """route=cloud: the cloud engine or an error (the cloud side refines this)."""
    if request.route != "cloud":
        return None
    if engines.available("cloud"):
        return RouteDecision("cloud", "requested")
    raise ApiError(
        "cloud_unavailable",
        "route 'cloud' was requested but no cloud engine is configured or it is unavailable",
        request.id,
    )


def local_rule(request: TtsRequest, engines: EngineSet) -> RouteDecision | None:
    """route=local/auto: the local engine when loaded and healthy, else the fallback voice."""
    if request.route not in ("local", "auto"):
        return None
    if engines.available("local"):
        return RouteDecision("local", "requested" if request.route == "local" else "local engine ready")
    slot = engines.slots["local"]
    why = {
        "loading": "local engine is loading",
        "failed": f"local engine failed to load: {slot.error}",
        "absent": "no local engine",
    }.get(slot.state, "local engine is unhealthy")
    if slot.engine is not None and not slot.healthy:
        why = f"local engine is unhealthy ({slot.failures} failures)"
    if engines.available("fallback"):
        return RouteDecision("fallback", why)
    raise ApiError("engine_unavailable", f"{why}, and the fallback voice is off or missing", request.id)


class Router:
    def __init__(self, engines: EngineSet, settings: RoutingSettings) -> None:
        self.engines = engines
        self.settings = settings
        self.rules: list[Rule] = [cloud_rule, local_rule]

    def decide(self, request: TtsRequest) -> RouteDecision:
        for rule in self.rules:
            decision = rule(request, self.engines)
            if decision is not None:
                return decision
        raise ApiError("engine_unavailable", f"no route serves route={request.route!r}", request.id)

    def after_failure(self, failed: RouteDecision, error: str, audio_out: bool) -> RouteDecision | None:
        """What to try after `failed` raised; None: give up (error to the client)."""
        if audio_out or failed.target == "fallback" or not self.settings.fallback_on_error:
            return None
        if self.engines.available("fallback"):
            return RouteDecision("fallback", f"{failed.target} engine failed: {error}")
        return None
