"""A real Mosquitto broker on a free loopback port, for tests."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


def mosquitto_binary() -> str | None:
    return shutil.which("mosquitto") or (
        "/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None
    )


class Broker:
    """One mosquitto process; `restart()` keeps the port (and, with
    persistence, the retained messages and sessions)."""

    def __init__(self, workdir: Path, port: int | None = None, extra_conf: str = "") -> None:
        binary = mosquitto_binary()
        if binary is None:
            raise RuntimeError("mosquitto is not installed (apt-get install mosquitto)")
        self.binary = binary
        self.workdir = workdir
        self.port = port or free_port()
        self.conf = workdir / "mosquitto.conf"
        self.conf.write_text(
            f"listener {self.port} 127.0.0.1\n"
            "allow_anonymous true\n"
            "set_tcp_nodelay true\n"
            "persistence true\n"
            f"persistence_location {workdir}/\n"
            "max_queued_messages 10000\n"
            f"{extra_conf}\n"
        )
        self.log = workdir / "mosquitto.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "-c", str(self.conf)],
            stdout=self.log.open("ab"), stderr=subprocess.STDOUT,
        )
        wait_for_port(self.port)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()


@contextmanager
def running_broker(extra_conf: str = "") -> Iterator[Broker]:
    with tempfile.TemporaryDirectory(prefix="cosyedge-mqtt-") as tmp:
        # mosquitto started as root drops to its own user: without write access to
        # its persistence_location it keeps no sessions or retained messages across
        # a restart ("Error saving in-memory database ... Permission denied").
        os.chmod(tmp, 0o777)
        broker = Broker(Path(tmp), extra_conf=extra_conf)
        broker.start()
        try:
            yield broker
        finally:
            broker.stop()
