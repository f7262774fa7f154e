"""systemd's sd_notify protocol, our own few lines: datagrams of
`KEY=VALUE` lines to the unix socket in $NOTIFY_SOCKET (a leading '@'
means the abstract namespace). Without the variable every call is a no-op."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator

log = logging.getLogger(__name__)


class SdNotifier:
    def __init__(
        self,
        socket_path: str | None = None,
        watchdog_usec: str | None = None,
        watchdog_pid: str | None = None,
    ) -> None:
        env = os.environ
        path = socket_path if socket_path is not None else env.get("NOTIFY_SOCKET", "")
        self.address = ("\0" + path[1:]) if path.startswith("@") else path
        wd = watchdog_usec if watchdog_usec is not None else env.get("WATCHDOG_USEC", "")
        pid = watchdog_pid if watchdog_pid is not None else env.get("WATCHDOG_PID", "")
        # WATCHDOG_PID names the process the watchdog is meant for (not a child of it).
        mine = not pid or pid == str(os.getpid())
        self.watchdog_s = int(wd) / 1e6 if wd.isdigit() and int(wd) > 0 and mine else None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def notify(self, *fields: str) -> bool:
        if not self.address:
            return False
        message = "\n".join(fields).encode()
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.sendto(message, self.address)
                return True
            except OSError as exc:
                log.warning("sd_notify(%s) failed: %s", fields[0] if fields else "", exc)
                return False

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def reloading(self) -> bool:
        return self.notify("RELOADING=1")

    def stopping(self, status: str = "") -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    @contextlib.contextmanager
    def extending(self, status: str, step_s: float = 30.0) -> Iterator[None]:
        """While the body runs (an engine loads), keep pushing systemd's start
        timeout out by `step_s`, renewed every step_s / 3."""
        done = threading.Event()
        self.status(status)

        def pump() -> None:
            while True:
                self.extend_timeout(step_s)
                if done.wait(step_s / 3):
                    return

        thread = threading.Thread(target=pump, name="sd-extend", daemon=True) if self.enabled else None
        if thread:
            thread.start()
        try:
            yield
        finally:
            done.set()
            if thread:
                thread.join()

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
