"""`cosyedge run`: config → broker → devices → engines → Service, then
signals: SIGTERM/SIGINT drain and exit 0, SIGHUP re-reads the config (and
swaps the engine when the bundle changed). Wiring only."""

from __future__ import annotations

import argparse
import logging
import queue
import signal
import sys

from cosyedge_cloud.wire.broker import ensure_broker
from cosyedge_daemon.audio.vad_worker import VadWorker
from cosyedge_daemon.cli.default_bundle import ensure_tiny_bundle
from cosyedge_daemon.mqtt.connection import max_packet_bytes
from cosyedge_daemon.service.service import Service
from cosyedge_daemon.service.wiring import open_sink, start_voice_input
from cosyedge_daemon.settings.loader import load_settings, parse_broker_url
from cosyedge_daemon.settings.schema import Settings
from cosyedge_models.errors import CosyEdgeError, MissingExtraError

log = logging.getLogger(__name__)


def run_command(args: argparse.Namespace) -> int:
    settings = load_settings(getattr(args, "config", None), args)
    _apply_process_settings(settings)
    if settings.tts.engine == "cosyvoice" and not settings.tts.bundle:
        # No bundle configured: the tiny test bundle, built once with the build extra.
        try:
            args.bundle = str(ensure_tiny_bundle())
        except MissingExtraError:
            print("cosyedge run: no bundle configured and the build extra is not installed: build a bundle on a "
                  "build host (cosyedge model pull, or cosyedge build export: docs/models.md) and pass --bundle DIR "
                  "or set [tts] bundle, or install the build extra (pip install 'cosyedge[build]') for the tiny "
                  "test model",
                  file=sys.stderr)
            return 2
        settings = load_settings(getattr(args, "config", None), args)
    log.info(
        "device %s, topics %s/…, broker %s", settings.device_id, settings.topic_prefix, settings.mqtt.broker
    )
    signals: queue.SimpleQueue[int] = queue.SimpleQueue()
    previous = {
        s: signal.signal(s, lambda n, _f: signals.put(n))
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    }
    broker = ensure_broker(
        parse_broker_url(settings.mqtt.broker),
        settings.mqtt.local_broker,
        max_packet_bytes(settings.mqtt.max_payload_bytes),
    )
    voice_input: VadWorker | None = None
    service: Service | None = None
    try:
        service = Service(settings, sink=open_sink(settings))
        service.load_synthesizers()
        service.start()
        voice_input = start_voice_input(settings, service.voice)
        if voice_input is None and settings.wyoming_satellite.uri:
            log.warning("[wyoming.satellite]: no microphone (or [vad] disabled); the satellite only plays")
        if voice_input is not None:
            worker = voice_input
            service.speaking_listeners.append(worker.set_speaking)  # half-duplex
            service.extra_liveness["vad"] = lambda: bool(worker.alive)
            if service.wyoming is not None and service.wyoming.satellite is not None:
                worker.taps.append(service.wyoming.satellite)  # the mic, streamed to Home Assistant
        while True:
            try:
                # A timeout, not a plain blocking get: when the kernel delivers
                # the signal to another thread, the main thread's wait is not
                # interrupted and Python runs the handler only once it wakes.
                signum = signals.get(timeout=0.2)
            except queue.Empty:
                continue
            if signum == signal.SIGHUP:
                _reload_config(service, args)
                continue
            log.info("%s: draining", signal.Signals(signum).name)
            break
    finally:
        if voice_input is not None:
            voice_input.stop()
        if service is not None:
            service.stop()
        if broker is not None:
            broker.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    log.info("stopped")
    return 0


def _reload_config(service: Service, args: argparse.Namespace) -> None:
    service.notifier.reloading()
    try:
        new = load_settings(getattr(args, "config", None), args)
        _apply_process_settings(new)
        restart = service.apply_settings(new)
        log.info("config reloaded%s", f"; needs a restart: {', '.join(restart)}" if restart else "")
    except CosyEdgeError as exc:
        log.error("config not reloaded: %s", exc)
    finally:
        service.notifier.ready("ready (config reloaded)")


def _apply_process_settings(settings: Settings) -> None:
    """What the settings set for the whole process (here, its entry point, not in a library)."""
    interval_ms = settings.tts.python_switch_interval_ms
    if interval_ms / 1e3 != sys.getswitchinterval():
        sys.setswitchinterval(interval_ms / 1e3)
        log.info("Python's thread switch interval: %g ms", interval_ms)
