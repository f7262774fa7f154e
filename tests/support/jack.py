"""A real virtual sound card for the sounddevice tests: a JACK server with
its dummy driver (real-time paced, no hardware), started by the test under a
name of its own, and PortAudio re-initialised to see it. Debian's
libportaudio2 is built with JACK support; the server shows up as the device
"system" of the host API "JACK Audio Connection Kit"."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

JACKD_MISSING = "jackd is not installed (apt-get install jackd2); .ci/setup installs it"


def jack_available() -> str | None:
    """None if the JACK test server can be started here, else why not."""
    if shutil.which("jackd") is None or shutil.which("jack_connect") is None:
        return JACKD_MISSING
    try:
        import sounddevice  # noqa: F401
    except OSError as exc:
        return f"PortAudio is not available ({exc}); apt-get install libportaudio2"
    return None


@dataclass
class JackServer:
    name: str
    rate: int
    period: int

    def _env(self) -> dict[str, str]:
        return {**os.environ, "JACK_DEFAULT_SERVER": self.name, "JACK_NO_START_SERVER": "1"}

    def ports(self) -> list[str]:
        out = subprocess.run(["jack_lsp", "-s", self.name], capture_output=True, text=True, timeout=10,
                             env=self._env())
        return [p.strip() for p in out.stdout.splitlines() if p.strip()]

    def connect(self, src: str, dst: str) -> None:
        subprocess.run(["jack_connect", "-s", self.name, src, dst], check=True, capture_output=True,
                       timeout=10, env=self._env())

    def disconnect(self, src: str, dst: str) -> None:
        subprocess.run(["jack_disconnect", "-s", self.name, src, dst], capture_output=True, timeout=10,
                       env=self._env())

    def client_ports(self, direction: str) -> list[str]:
        """Our own (non-system) ports: direction "out" (playback) or "in" (capture)."""
        return [p for p in self.ports() if not p.startswith("system:") and f":{direction}_" in p]


def _reinit_portaudio() -> None:
    import sounddevice as sd

    sd._terminate()
    sd._initialize()


_counter = itertools.count()


@contextmanager
def jack_server(rate: int = 16000, period_ms: int = 30) -> Iterator[JackServer]:
    name = f"cosyedge-test-{os.getpid()}-{next(_counter)}-{rate}"  # never reuse a server name
    period = rate * period_ms // 1000
    server = JackServer(name, rate, period)
    # -t: a generous client timeout, so that a loaded machine does not get our client thrown out.
    # Its log goes to a file: a pipe nobody reads fills up with xrun messages and stalls jackd.
    cmd = ["jackd", "--no-realtime", "-t", "5000", "-n", name,
           "-d", "dummy", "-r", str(rate), "-p", str(period)]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "JACK_NO_START_SERVER": "1"})
        old = os.environ.get("JACK_DEFAULT_SERVER")
        started = False
        try:
            deadline = time.monotonic() + 30
            while "system:playback_1" not in server.ports():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("jackd did not start")
                time.sleep(0.1)
            os.environ["JACK_DEFAULT_SERVER"] = name  # libjack reads it when PortAudio connects
            _reinit_portaudio()
            started = True
            yield server
        finally:
            import sounddevice as sd

            if started:
                sd._terminate()  # PortAudio must leave the server before it goes (else libjack asserts)
            if old is None:
                os.environ.pop("JACK_DEFAULT_SERVER", None)
            else:
                os.environ["JACK_DEFAULT_SERVER"] = old
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if started:
                sd._initialize()  # without the server: its devices are gone
            else:
                log.seek(0)
                print("jackd output:\n" + log.read().decode(errors="replace")[-3000:])
