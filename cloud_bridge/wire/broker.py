"""A private Mosquitto for a fresh machine: when the configured broker is on
this host and nothing listens on its port, the daemon starts `mosquitto`
itself (loopback only, TCP_NODELAY) and stops it on exit."""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from cosyedge_cloud.wire.mqtt import BrokerAddress
from cosyedge_models.errors import CosyEdgeError

log = logging.getLogger(__name__)

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


def port_open(host: str, port: int, timeout_s: float = 0.3) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def find_mosquitto() -> str | None:
    return shutil.which("mosquitto") or next(
        (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if Path(p).exists()), None
    )


class LocalBroker:
    def __init__(self, port: int, max_packet_bytes: int = 0) -> None:
        self.port = port
        self.max_packet_bytes = max_packet_bytes  # 0: mosquitto's default (no limit)
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        binary = find_mosquitto()
        if binary is None:
            raise CosyEdgeError(
                f"no MQTT broker listens on localhost:{self.port} and mosquitto is not installed; "
                "install it (apt-get install mosquitto) or pass --broker URL"
            )
        self._dir = tempfile.TemporaryDirectory(prefix="cosyedge-broker-")
        conf = Path(self._dir.name) / "mosquitto.conf"
        limit = f"max_packet_size {self.max_packet_bytes}\n" if self.max_packet_bytes else ""
        conf.write_text(f"listener {self.port} 127.0.0.1\nallow_anonymous true\nset_tcp_nodelay true\n{limit}")
        log_file = (Path(self._dir.name) / "mosquitto.log").open("wb")
        self.proc = subprocess.Popen([binary, "-c", str(conf)], stdout=log_file, stderr=subprocess.STDOUT)
        log_file.close()
        deadline = time.monotonic() + timeout_s
        while not port_open("127.0.0.1", self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                out = (Path(self._dir.name) / "mosquitto.log").read_text(errors="replace")[-500:]
                self.stop()
                raise CosyEdgeError(f"could not start mosquitto on port {self.port}: {out}")
            time.sleep(0.05)
        log.info("started a private mosquitto on 127.0.0.1:%d (pid %d)", self.port, self.proc.pid)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


def ensure_broker(address: BrokerAddress, mode: str, max_packet_bytes: int = 0) -> LocalBroker | None:
    """Start a private broker when the address is local, nothing listens and
    `mode` is 'auto'; None when an existing broker (or a remote one) is used."""
    if mode != "auto" or address.tls or address.host not in LOCAL_HOSTS:
        return None
    if port_open(address.host, address.port):
        return None
    broker = LocalBroker(address.port, max_packet_bytes)
    broker.start()
    return broker
