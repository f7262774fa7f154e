"""`cosyedge bridge` as a process: a request survives the bridge being
killed in the middle of its stream (QoS 1, persistent session, acknowledged
only once answered), and SIGTERM drains."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cloud_bridge.protocol import CloudRequest
from cloud_bridge.triton_launcher import TritonServer
from tests.cloud_bridge.device import Device
from tests.cloud_bridge.helpers import wait_for
from tests.support.broker import Broker

ROOT = Path(__file__).resolve().parents[2]


class BridgeProcess:
    def __init__(self, config: Path, log: Path) -> None:
        self.config, self.log = config, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daemon", "bridge", "--config", str(self.config)],
            cwd=ROOT,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
        )
        assert wait_for(lambda: "connected to" in self.log.read_text(errors="replace"), 30), (
            self.log.read_text()
        )

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout_s)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture()
def bridge_process(broker: Broker, triton: TritonServer, tmp_path: Path) -> Iterator[BridgeProcess]:
    config = tmp_path / "bridge.toml"
    config.write_text(
        f'[mqtt]\nbroker = "{broker.url}"\nclient_id = "bridge-proc-1"\n'
        f'[triton]\nurl = "{triton.grpc_url}"\n[limits]\ndrain_timeout_s = 10.0\n[metrics]\nport = 0\n'
    )
    process = BridgeProcess(config, tmp_path / "bridge.log")
    process.start()
    yield process
    process.close()


def test_bridge_killed_mid_stream_still_answers(broker, bridge_process) -> None:  # type: ignore[no-untyped-def]
    device = Device(broker.url, "kitchen")
    try:
        request = CloudRequest(id="survivor", text="x {chunks=12} {delay_ms=100}", model_version="1", seed=5)
        answer = device.send(request)
        assert wait_for(lambda: len(answer.audio) >= 3, 15)
        bridge_process.signal(signal.SIGKILL)  # no drain, no DISCONNECT: the request stays unacknowledged
        bridge_process.wait(5)
        got_before = len(answer.audio)
        assert got_before < 12 and not answer.finished.is_set()
        time.sleep(0.5)
        bridge_process.start()  # same client id: the broker delivers the request again
        assert answer.finished.wait(30), bridge_process.log.read_text()
    finally:
        device.close()
    assert answer.done is not None, answer.error
    assert answer.done.summary["redelivered"] is True
    # synthesized again from the start; the seed makes it the same audio, so a device can skip what it has
    seqs = [a.seq for a in answer.audio]
    assert seqs[:got_before] == list(range(got_before))
    assert seqs[got_before:] == list(range(12))
    assert answer.audio[0].pcm16 == answer.audio[got_before].pcm16


def test_sigterm_drains_then_exits_zero(broker, bridge_process) -> None:  # type: ignore[no-untyped-def]
    device = Device(broker.url, "kitchen")
    try:
        answer = device.send(CloudRequest(id="term", text="x {chunks=10} {delay_ms=100}", model_version="1"))
        assert wait_for(lambda: len(answer.audio) >= 1, 15)
        bridge_process.signal(signal.SIGTERM)
        assert bridge_process.wait(15) == 0
        assert answer.finished.wait(5)
    finally:
        device.close()
    assert answer.done is not None and len(answer.audio) == 10
    assert "bridge stopped (drained)" in bridge_process.log.read_text()
