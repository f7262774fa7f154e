"""`cosyedge run --config FILE --wyoming-uri tcp://…` as a real process:
the flag starts the Wyoming listener, it answers as Home Assistant expects,
and SIGTERM still exits 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from wyoming.info import Describe, Info
from wyoming.tts import Synthesize

from tests.daemon.service.test_process import ROOT, Daemon
from tests.support.broker import Broker
from tests.support.wyoming_client import exchange, run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_run_with_wyoming_uri_flag(tmp_path: Path, broker: Broker) -> None:
    port = _free_port()
    d = Daemon(tmp_path, broker, "[health]\nmetrics_port = 0\n")  # espeak-ng engine, no audio device
    d.proc.terminate()
    d.proc.wait(10)
    d.proc = subprocess.Popen(
        [sys.executable, "-m", "cosyedge_daemon", "run", "--config", str(d.config), "--wyoming-uri",
         f"tcp://127.0.0.1:{port}"], cwd=ROOT, stdout=d.log, stderr=subprocess.STDOUT,
        env={**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify"), "PYTHONUNBUFFERED": "1"})
    try:
        d.wait_note("READY=1", 60)
        info = Info.from_event(run(exchange(port, [Describe().event()], ("info",)))[-1])
        assert info.tts and info.tts[0].supports_synthesize_streaming
        got = run(exchange(port, [Synthesize(text="Hello from a process.").event()], ("audio-stop", "error"), 60))
        assert got[-1].type == "audio-stop" and sum(e.type == "audio-chunk" for e in got) >= 1
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(30) == 0
    finally:
        d.close()
