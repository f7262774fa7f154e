"""`cosyedge bridge [--config FILE] [--broker URL] [--triton URL]`: wires
the settings, the bridge service and the signals together."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from types import FrameType

from cosyedge_cloud.bridge.settings import load_settings

log = logging.getLogger(__name__)


def bridge_command(args: argparse.Namespace) -> int:
    from cosyedge_cloud.bridge.service import BridgeService  # paho, tritonclient: only for this command

    settings = load_settings(
        getattr(args, "config", None),
        broker=getattr(args, "broker", None),
        triton_url=getattr(args, "triton", None),
    )
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("%s: draining", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    service = BridgeService(settings)
    log.info(
        "bridge %s: broker %s, Triton %s model %s, up to %d in flight (+%d queued, overflow %s), metrics on %s",
        settings.mqtt.client_id,
        settings.mqtt.broker,
        settings.triton.url,
        settings.triton.model,
        settings.limits.max_in_flight,
        settings.limits.max_queued,
        settings.limits.overflow,
        f"{settings.metrics.address}:{settings.metrics.port}" if settings.metrics.port else "off",
    )
    service.start()
    while not stop.wait(1.0):
        pass
    clean = service.stop()
    log.info("bridge stopped (%s)", "drained" if clean else "drain timeout: cancelled the rest")
    return 0
