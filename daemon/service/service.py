"""The daemon as one object: synthesizers, scheduler, pipeline, MQTT, intake,
health and metrics put together, with start, drain-and-stop, engine reload
and live settings. `service_main.run_command` adds only signals, devices and
the config file; tests drive this class directly."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cosyedge_daemon.api.intake import Intake
from cosyedge_daemon.api.responders import NativeResponder
from cosyedge_daemon.api.vad_topics import VoiceLink
from cosyedge_daemon.audio.barge_in import BargeInPolicy
from cosyedge_daemon.audio.interfaces import AudioSink
from cosyedge_daemon.mqtt.connection import InboundMessage, MqttConnection
from cosyedge_daemon.request.request import TtsRequest
from cosyedge_daemon.service.health import HealthMonitor
from cosyedge_daemon.service.sdnotify import SdNotifier
from cosyedge_daemon.serving.admission import Admission
from cosyedge_daemon.serving.answer import Completer
from cosyedge_daemon.serving.metrics import Metrics
from cosyedge_daemon.serving.pipeline import Pipeline
from cosyedge_daemon.serving.scheduler import Scheduler
from cosyedge_daemon.settings.schema import SECTIONS, Settings, section_attr
from cosyedge_daemon.synthesizers.cloud import CloudSynthesizer, describe_link
from cosyedge_daemon.synthesizers.factory import load_local_synthesizer, make_fallback
from cosyedge_daemon.synthesizers.routing import Router, SynthesizerSet
from cosyedge_daemon.wyoming.frontend import WyomingFrontend
from cosyedge_daemon.wyoming.frontend import enabled as wyoming_enabled
from cosyedge_models.backends.graph_thread import CAPTURE_AT_LOAD_BACKENDS
from cosyedge_models.settings_schema import live_fields, reload_fields
from cosyedge_models.synthesis.api import ServedSynthesizer

if TYPE_CHECKING:
    from cosyedge_daemon.http.server import HttpFrontend

log = logging.getLogger(__name__)

VERSION = "0.1.0"


class Service:
    def __init__(
        self,
        settings: Settings,
        *,
        sink: AudioSink | None = None,
        notifier: SdNotifier | None = None,
        barge_in: BargeInPolicy | None = None,
    ) -> None:
        self.settings = settings
        self.sink = sink
        self.notifier = notifier or SdNotifier()
        self.metrics = Metrics()
        self.metrics.synthesis_workers.set(settings.tts.synthesis_worker_count)
        self.synthesizers = SynthesizerSet(settings.routing)
        workers = settings.tts.synthesis_worker_count
        self.scheduler = Scheduler(settings.scheduler, concurrency=workers)
        self.router = Router(self.synthesizers, settings.routing, load=self._local_load)
        self.completer = Completer(self.scheduler, self.metrics, settings.health.log_traces)
        self.speaking_listeners: list[Callable[[bool], None]] = []
        self.pipeline = Pipeline(
            self.scheduler,
            self.router,
            self.completer,
            settings.scheduler,
            sink,
            on_speaking=self._speaking_changed,
            workers=workers,
        )
        self.conn = MqttConnection(
            settings.mqtt,
            f"cosyedge-{settings.device_id}",
            settings.topics.status,
            [],
            on_message=self._on_message,
            on_connected=self._on_connected,
        )
        self.native = NativeResponder(self.conn, settings.topics, settings.mqtt.audio_header)
        self.admission = Admission(settings, self.scheduler, self.pipeline)
        self.intake = Intake(settings, self.admission, self.conn, self.native, self.metrics, self.request_reload)
        self.conn.subscriptions = self.intake.subscriptions()
        self.cloud: CloudSynthesizer | None = None
        if settings.cloud.enabled:
            self.cloud = CloudSynthesizer(self.conn, settings.device_id, settings.cloud)
            self.conn.subscriptions += self.cloud.subscriptions()
            self.synthesizers.slots["cloud"].swap(self.cloud)
        self.intake.set_input_topics(self.conn.subscriptions)
        policy = barge_in or BargeInPolicy(settings.vad_settings)
        self.voice = VoiceLink(
            self.conn,
            settings.topics,
            self.pipeline,
            self.metrics,
            policy,
            settings.site_ids[0] if settings.hermes.enabled else None,
        )
        self.extra_liveness: dict[str, Callable[[], bool]] = {}  # e.g. the audio capture worker
        self.wyoming: WyomingFrontend | None = None
        if wyoming_enabled(settings):
            self.wyoming = WyomingFrontend(
                settings, self.admission, self.synthesizers, self.pipeline, self.voice, VERSION
            )
            self.extra_liveness["wyoming"] = self.wyoming.alive
        self.http: HttpFrontend | None = None
        if settings.http.listen:
            from cosyedge_daemon.http.server import HttpFrontend  # aiohttp (25 MB) only when the API is on

            self.http = HttpFrontend(settings.http, self.admission, self.synthesizers)
            self.extra_liveness["http"] = self.http.alive
        self.health = HealthMonitor(
            self.notifier,
            self.liveness,
            self.health_doc,
            self._publish_health,
            settings.health.health_interval_s,
            on_tick=[self._housekeeping],
        )
        self.state = "starting"
        self.metrics_port: int | None = None
        self._started_at = time.monotonic()
        self._reload_lock = threading.Lock()
        self._reload_threads: list[threading.Thread] = []

    # --- synthesizers ----------------------------------------------------------------------
    def _on_message(self, msg: InboundMessage) -> None:
        cloud = self.cloud
        if cloud is not None and cloud.handles(msg.topic):
            cloud.on_message(msg)
        else:
            self.intake.on_message(msg)

    def _local_load(self, request: TtsRequest) -> tuple[int, float]:
        """For the router: requests waiting, and the estimated wait before this one is done locally."""
        return self.scheduler.depth, self.scheduler.estimated_wait_s(request.priority)

    def set_synthesizers(self, local: ServedSynthesizer | None, fallback: ServedSynthesizer | None) -> None:
        self._swap_local(local)
        self.synthesizers.slots["fallback"].swap(fallback)

    def _swap_local(self, engine: ServedSynthesizer | None) -> None:
        """The local engine, and the scheduler's bound on local requests at once: an engine that
        serves fewer streams at once than the workers (the GPU flow's seats) leaves the rest queued
        here, where the router's queue-depth and deadline rules can send them to the cloud."""
        self.synthesizers.slots["local"].swap(engine)
        streams = engine.concurrent_streams() if engine is not None else None
        if streams is not None and streams < self.pipeline.workers:
            log.info("the local engine serves %d requests at once (%d synthesis workers): the rest wait in "
                     "the queue", streams, self.pipeline.workers)
        self.scheduler.set_local_limit(streams)

    def load_synthesizers(self) -> None:
        """The configured local engine (systemd's start timeout is extended
        while it loads) and the fallback voice at its sample rate."""
        slot = self.synthesizers.slots["local"]
        slot.set_state("loading")
        local = None
        with self.notifier.extending("loading the speech engine"):
            try:
                local = load_local_synthesizer(self.settings)
                self._swap_local(local)
            except Exception as exc:
                log.error("the local engine did not load: %s", exc)
                slot.set_state("failed", str(exc))
        self.synthesizers.slots["fallback"].swap(
            make_fallback(self.settings.fallback, local.sample_rate if local else None)
        )

    def request_reload(self, bundle: str | None = None) -> threading.Thread:
        """Load the engine (of `bundle`, else the configured one) beside the
        current one, switch, and close the old one when its requests end."""
        thread = threading.Thread(target=self._reload, args=(bundle,), name="engine-reload", daemon=True)
        self._reload_threads = [t for t in self._reload_threads if t.is_alive()]  # bounded: many reloads
        self._reload_threads.append(thread)
        thread.start()
        return thread

    def _reload(self, bundle: str | None) -> None:
        with self._reload_lock:
            log.info("reloading the local engine%s", f" from {bundle}" if bundle else "")
            slot = self.synthesizers.slots["local"]
            # A GPU engine captures its CUDA graphs at load, which no other GPU work may
            # overlap: local requests wait while it loads (after the running ones end).
            quiet = self.settings.tts.engine == "cosyvoice" and self.settings.tts.backend in CAPTURE_AT_LOAD_BACKENDS
            self.notifier.status("loading a new engine" + (", local requests wait" if quiet else
                                                           " beside the current one"))
            pause = slot.paused(self.settings.health.stop_timeout_s) if quiet else contextlib.nullcontext(True)
            with pause as drained:
                if not drained:
                    log.warning("reload: requests still running after %.0f s; loading anyway",
                                self.settings.health.stop_timeout_s)
                try:
                    engine = load_local_synthesizer(self.settings, bundle)
                except Exception as exc:
                    log.error("reload failed, keeping the current engine: %s", exc)
                    self.notifier.status(f"reload failed: {exc}")
                    return
                self._swap_local(engine)
            log.info("switched to the new engine %s", engine.name)
            self.notifier.status("ready (engine reloaded)")
            self.health.poke()

    # --- lifecycle ------------------------------------------------------------------
    def start(self, connect_timeout_s: float = 5.0) -> None:
        h = self.settings.health
        if h.metrics_port:
            self.metrics_port = self.metrics.serve(h.metrics_host, h.metrics_port)
        if self.sink is not None:
            self.sink.start()
        self.pipeline.start()
        self.intake.start()
        if self.wyoming is not None:
            self.wyoming.start()
        if self.http is not None:
            self.http.start()
        self.conn.start()
        if not self.conn.wait_connected(connect_timeout_s):
            log.warning(
                "no broker connection yet (%s); serving as soon as it is up", self.settings.mqtt.broker
            )
        self.state = "ready"
        self.health.start()
        self.notifier.ready(self._status_line())

    def stop(self, timeout_s: float | None = None) -> None:
        """Drain: refuse new requests (shutting_down), let in-flight ones finish
        within `timeout_s`, stop the rest with an error, publish offline."""
        timeout_s = self.settings.health.stop_timeout_s if timeout_s is None else timeout_s
        self.state = "stopping"
        self.notifier.stopping("draining")
        self.admission.close()
        self.health.publish_if_due(force=True)
        self.admission.drain(timeout_s)
        self.health.stop()
        if self.wyoming is not None:
            self.wyoming.stop()
        if self.http is not None:
            self.http.stop()
        self.pipeline.stop(2.0)
        self.intake.stop()
        self.state = "stopped"
        self.health.publish_if_due(force=True)
        self.conn.stop()
        for t in self._reload_threads:
            t.join(1.0)
        self.metrics.close()
        self.synthesizers.close()
        if self.sink is not None:
            self.sink.close()
        self.notifier.close()

    # --- live settings (SIGHUP) ----------------------------------------------------
    def apply_settings(self, new: Settings) -> list[str]:
        """Apply what can change live; returns the changed keys that need a restart."""
        restart: list[str] = []
        old_workers = self.settings.tts.synthesis_workers
        merged: dict[str, Any] = {}
        reload_engine = False
        for name, cls in SECTIONS.items():
            old_sec, new_sec = getattr(self.settings, section_attr(name)), getattr(new, section_attr(name))
            changes = {}
            for f in dataclasses.fields(cls):
                before, after = getattr(old_sec, f.name), getattr(new_sec, f.name)
                if before == after:
                    continue
                if f.name in live_fields(cls) or f.name in reload_fields(cls):
                    changes[f.name] = after
                    reload_engine |= f.name in reload_fields(cls)
                else:
                    restart.append(f"[{name}] {f.name}")
            merged[section_attr(name)] = dataclasses.replace(old_sec, **changes)
        if (new.tts.synthesis_workers == old_workers == "auto"
                and new.tts.synthesis_worker_count != self.pipeline.workers):
            restart.append("[tts] synthesis_workers (auto follows llm_max_batch_size)")
        for key in ("device_id", "audio", "vad"):
            if getattr(self.settings, key) != getattr(new, key):
                restart.append(key)
        old = self.settings
        self.settings = dataclasses.replace(old, **merged)
        self._push_settings(old)
        if reload_engine:
            self.request_reload()
        for key in restart:
            log.warning("config change of %s needs a restart (systemctl restart cosyedge)", key)
        return restart

    def _push_settings(self, old: Settings) -> None:
        s = self.settings
        self.scheduler.reconfigure(s.scheduler)
        self.pipeline.settings = s.scheduler
        self.synthesizers.reconfigure(s.routing)
        self.router.settings = s.routing
        if self.cloud is not None:
            self.cloud.settings = dataclasses.replace(self.cloud.settings, **_live(s.cloud))
        self.admission.reconfigure(s)  # the limits and defaults of every front end
        self.intake.reconfigure(s)
        self.completer.log_traces = s.health.log_traces
        self.health.interval_s = s.health.health_interval_s
        if s.fallback.enabled != old.fallback.enabled:
            local = self.synthesizers.slots["local"].engine
            self.synthesizers.slots["fallback"].swap(
                make_fallback(s.fallback, local.sample_rate if local else None)
                if s.fallback.enabled
                else None
            )
        self.health.poke()

    # --- health -------------------------------------------------------------------
    def liveness(self) -> dict[str, bool]:
        stall = self.settings.health.watchdog_stall_s
        alive = self.pipeline.workers_alive(stall)
        alive["intake"] = self.intake.alive(stall)
        for name, check in self.extra_liveness.items():
            alive[name] = check()
        return alive

    def _overall_state(self) -> str:
        if self.state != "ready":
            return self.state
        if self.health.dead or not self.synthesizers.available("local") or self.scheduler.degraded():
            return "degraded"
        return "ready"

    def health_doc(self) -> dict[str, Any]:
        return {
            "device_id": self.settings.device_id,
            "state": self._overall_state(),
            "version": VERSION,
            "engines": {t: slot.describe() for t, slot in self.synthesizers.slots.items()},
            "workers": self.liveness(),
            "audio": {"output": self.sink is not None, "speaking": self.pipeline.speaking},
            "mqtt": {"protocol": self.settings.mqtt.protocol},
            "cloud": {"enabled": self.cloud is not None, "link": describe_link(self.cloud)},
            "wyoming": self.wyoming.describe() if self.wyoming is not None else {},
            "http": self.http.describe() if self.http is not None else {},
            "queue_depth": self.scheduler.depth,
            "in_flight": len(self.scheduler.running()),
            "synthesizing": self.pipeline.active_syntheses,
            "local_at_once": self.scheduler.local_limit,  # the local engine's bound; null: the workers
            "underruns": self.sink.underruns if self.sink is not None else 0,
            "uptime_s": round(time.monotonic() - self._started_at, 1),
            "time": round(time.time(), 3),
        }

    def _status_line(self) -> str:
        local = self.synthesizers.slots["local"].describe()
        return f"{self._overall_state()}: local engine {local['state']}, queue {self.scheduler.depth}"

    def _publish_health(self, payload: bytes) -> None:
        if self.conn.connected.is_set():
            self.conn.publish(self.settings.topics.health, payload, retain=True)

    def _housekeeping(self) -> None:
        self.admission.expire()
        m = self.metrics
        m.queue_depth.set(self.scheduler.depth)
        m.in_flight.set(len(self.scheduler.running()))
        m.active_syntheses.set(self.pipeline.active_syntheses)
        m.playback_waiting.set(self.pipeline.order.waiting_jobs())
        if self.sink is not None:
            m.underruns.set(self.sink.underruns)
        m.mqtt_connected.set(1.0 if self.conn.connected.is_set() else 0.0)
        m.mqtt_reconnects.set(self.conn.connect_count)
        m.set_engine_states({t: str(slot.describe()["state"]) for t, slot in self.synthesizers.slots.items()})

    def _on_connected(self) -> None:
        self.health.poke()

    def _speaking_changed(self, speaking: bool) -> None:
        self.voice.on_speaking_changed(speaking)
        for listener in self.speaking_listeners:
            listener(speaking)
        self.health.poke()


def _live(section: object) -> dict[str, Any]:
    """The fields of a settings section that SIGHUP may change."""
    return {name: getattr(section, name) for name in live_fields(type(section))}
