"""The health thread: every tick it checks that the worker threads are alive
(and only then pings the systemd watchdog), runs the periodic housekeeping
(deadlines, metrics gauges), and publishes the retained health JSON on
`<prefix>/status/health` when it changes and every `health_interval_s`."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from cosyedge_daemon.service.sdnotify import SdNotifier

log = logging.getLogger(__name__)

# Fields that change all the time; a change of them alone is not published.
_VOLATILE = ("uptime_s", "time", "queue_depth", "in_flight", "synthesizing", "underruns", "requests")


class HealthMonitor:
    def __init__(
        self,
        notifier: SdNotifier,
        liveness: Callable[[], dict[str, bool]],
        snapshot: Callable[[], dict[str, Any]],
        publish: Callable[[bytes], None],
        interval_s: float,
        tick_s: float = 0.2,
        on_tick: list[Callable[[], None]] | None = None,
    ) -> None:
        self.notifier = notifier
        self.liveness = liveness
        self.snapshot = snapshot
        self.publish = publish
        self.interval_s = interval_s
        self.tick_s = tick_s
        if notifier.watchdog_s:  # pings go out every quarter of the watchdog period
            self.tick_s = min(tick_s, notifier.watchdog_s / 8)
        self.on_tick = on_tick or []
        self.dead: list[str] = []
        self._stop = threading.Event()
        self._changed = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_doc: dict[str, Any] | None = None
        self._last_sent = 0.0
        self._last_ping = 0.0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def poke(self) -> None:
        """Something changed: publish the health document on the next tick."""
        self._changed.set()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.tick()
            except Exception:
                log.exception("health tick failed")

    def tick(self) -> None:
        for fn in self.on_tick:
            fn()
        workers = self.liveness()
        dead = sorted(name for name, ok in workers.items() if not ok)
        if dead != self.dead:
            if dead:
                log.error("worker(s) %s stopped or stalled; no more watchdog pings", ", ".join(dead))
            self.dead = dead
            self._changed.set()
        now = time.monotonic()
        wd = self.notifier.watchdog_s
        if not dead and wd is not None and now - self._last_ping >= wd / 4:
            self.notifier.watchdog()
            self._last_ping = now
        self.publish_if_due()

    def publish_if_due(self, force: bool = False) -> None:
        doc = self.snapshot()
        stable = {k: v for k, v in doc.items() if k not in _VOLATILE}
        now = time.monotonic()
        if (
            force
            or self._changed.is_set()
            or stable != self._last_doc
            or now - self._last_sent >= self.interval_s
        ):
            self._changed.clear()
            self._last_doc = stable
            self._last_sent = now
            self.publish(json.dumps(doc).encode())
