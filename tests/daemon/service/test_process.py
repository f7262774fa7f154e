"""The real `python -m cosyedge_daemon run` process: READY over sd_notify, SIGHUP
reloads the config, SIGTERM under load drains and exits 0 in time with every
request answered and `offline` published."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon.api.test_daemon_api import LONG
from tests.support.broker import Broker
from tests.support.mqtt_recorder import Recorder

ROOT = Path(__file__).resolve().parents[3]


class Daemon:
    def __init__(self, tmp: Path, broker: Broker, extra: str = "") -> None:
        self.device = f"proc{os.getpid() % 10000}{int(time.monotonic() * 1000) % 100000}"
        self.prefix = f"cosyedge/{self.device}"
        self.config = tmp / "cosyedge.toml"
        self.broker_url = broker.url
        self.write("", extra)
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(tmp / "notify"))
        self.notify.settimeout(0.1)
        self.log = (tmp / "daemon.log").open("w+b")
        env = {**os.environ, "NOTIFY_SOCKET": str(tmp / "notify"), "PYTHONUNBUFFERED": "1",
               "PYTHONFAULTHANDLER": "1"}  # SIGABRT dumps every thread's stack into the log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cosyedge_daemon", "run", "--config", str(self.config)],
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.notes: list[str] = []

    def write(self, mqtt_extra: str, rest: str, tts_extra: str = "") -> None:
        self.config.write_text(
            f'device_id = "{self.device}"\n[mqtt]\nbroker = "{self.broker_url}"\n{mqtt_extra}'
            f'[tts]\nengine = "espeak-ng"\n{tts_extra}[audio]\ndevice = "none"\n' + rest
        )

    def wait_note(self, prefix: str, timeout_s: float = 30.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for n in self.notes:
                if n.startswith(prefix):
                    self.notes.remove(n)
                    return n
            try:
                self.notes.append(self.notify.recv(4096).decode())
            except TimeoutError:
                if self.proc.poll() is not None:
                    break
        raise AssertionError(f"no sd_notify {prefix!r}; got {self.notes}; log:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.notify.close()
        self.log.close()


@pytest.fixture()
def daemon_proc(tmp_path: Path, broker: Broker) -> Iterator[Daemon]:
    d = Daemon(tmp_path, broker, "[health]\nmetrics_port = 0\nstop_timeout_s = 3.0\n")
    try:
        yield d
    finally:
        d.close()


def test_sighup_reloads_config(daemon_proc: Daemon, broker: Broker) -> None:
    d = daemon_proc
    d.wait_note("READY=1")
    d.write("keepalive_s = 45\n", "[scheduler]\nmax_queue = 7\n[health]\nmetrics_port = 0\n",
            "python_switch_interval_ms = 0.5\n")
    d.proc.send_signal(signal.SIGHUP)
    d.wait_note("RELOADING=1", 10)
    d.wait_note("READY=1", 10)
    out = d.output()
    assert "config reloaded; needs a restart: [mqtt] keepalive_s" in out
    assert "Python's thread switch interval: 0.5 ms" in out  # a live setting, the whole process's
    d.write("", "[scheduler]\nmax_queue = 0\n")
    d.proc.send_signal(signal.SIGHUP)
    d.wait_note("READY=1", 10)
    assert "config not reloaded: [scheduler] max_queue = 0: must be between 1 and 10000" in d.output()
    assert d.proc.poll() is None  # a bad config on reload keeps the daemon running
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(10) == 0


def test_sigterm_under_load_drains(daemon_proc: Daemon, broker: Broker) -> None:
    d = daemon_proc
    d.wait_note("READY=1")
    probe = Recorder(broker.url, [f"{d.prefix}/tts/#", f"{d.prefix}/status"])
    try:
        _drain_under_load(d, probe)
    except (AssertionError, TimeoutError, subprocess.TimeoutExpired) as exc:
        if d.proc.poll() is None:
            d.proc.send_signal(signal.SIGABRT)
            d.proc.wait(5)
        raise AssertionError(f"{exc}\ndaemon log:\n{d.output()[-6000:]}") from exc
    finally:
        probe.close()
    assert "SIGTERM: draining" in d.output()


def _drain_under_load(d: Daemon, probe: Recorder) -> None:
    ids = [f"load{n}" for n in range(20)]
    for rid in ids:
        probe.publish(f"{d.prefix}/tts/say", {"id": rid, "text": LONG, "output": "publish"})
    probe.wait_topic(f"{d.prefix}/tts/done/load0", 20)
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(15) == 0
    d.wait_note("STOPPING=1", 2)
    # the daemon's last message is its offline status: every answer it sent came before
    probe.wait_for(lambda m: m.topic == f"{d.prefix}/status" and m.payload == b"offline", 10)
    answers = {}
    for rid in ids:
        done = probe.on(f"{d.prefix}/tts/done/{rid}")
        err = probe.on(f"{d.prefix}/tts/error/{rid}")
        assert len(done) + len(err) == 1, f"{rid}: {len(done)} done, {len(err)} errors"
        answers[rid] = "done" if done else err[0].json()["code"]
    assert set(answers.values()) <= {"done", "shutting_down"}
    assert "shutting_down" in answers.values()  # the drain cut what stop_timeout_s left: it did not wait for all
    statuses = [m.payload for m in probe.on(f"{d.prefix}/status")]
    assert statuses[-1] == b"offline"
