"""`cosyedge bridge` as a process: a request survives the bridge being
killed in the middle of its stream (QoS 1, persistent session, acknowledged
only once answered), and SIGTERM drains."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cosyedge_cloud.triton.launcher import TritonServer
from cosyedge_cloud.wire.protocol import CloudRequest

from tests.cloud_bridge.conftest import SINE_MODEL
from tests.cloud_bridge.device import Device
from tests.support.broker import Broker
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[3]


class BridgeProcess:
    def __init__(self, config: Path, log: Path) -> None:
        self.config, self.log = config, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cosyedge_daemon", "bridge", "--config", str(self.config)],
            cwd=ROOT,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
        )
        assert wait_for(lambda: "connected to" in self.log.read_text(errors="replace"), 30), self.log.read_text()

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
def start_bridge(broker: Broker, triton: TritonServer, tmp_path: Path) -> Iterator[Callable[[str], BridgeProcess]]:
    started: list[BridgeProcess] = []

    def start(model: str) -> BridgeProcess:
        config = tmp_path / f"bridge-{model}.toml"
        config.write_text(
            f'[mqtt]\nbroker = "{broker.url}"\nclient_id = "bridge-proc-1"\n'
            f'[triton]\nurl = "{triton.grpc_url}"\nmodel = "{model}"\nfirst_chunk_timeout_s = 120.0\n'
            f"chunk_timeout_s = 120.0\n[limits]\ndrain_timeout_s = 10.0\n[metrics]\nport = 0\n"
        )
        process = BridgeProcess(config, tmp_path / "bridge.log")
        process.start()
        started.append(process)
        return process

    yield start
    for process in started:
        process.close()


def test_bridge_killed_mid_stream_still_answers(broker, start_bridge) -> None:  # type: ignore[no-untyped-def]
    bridge = start_bridge("cosyvoice2")  # the real model on the tiny bundle
    device = Device(broker.url, "kitchen")
    text = "The quick brown fox jumps over the lazy dog. It was a sunny day in the park."
    try:
        answer = device.send(CloudRequest(id="survivor", text=text, model_version="1", seed=5))
        assert wait_for(lambda: len(answer.audio) >= 2, 120), bridge.log.read_text()
        bridge.signal(signal.SIGKILL)  # no drain, no DISCONNECT: the request stays unacknowledged
        bridge.wait(5)
        got_before = len(answer.audio)
        assert not answer.finished.is_set()
        bridge.start()  # same client id: the broker delivers the request again
        assert answer.finished.wait(180), bridge.log.read_text()
    finally:
        device.close()
    assert answer.done is not None, answer.error
    assert answer.done.summary["redelivered"] is True
    # synthesized again from the start with the same seed: the same chunks again, so a device that
    # has chunks 0..k-1 drops those and plays on from k
    first, second = answer.audio[:got_before], answer.audio[got_before:]
    assert [a.seq for a in first] == list(range(got_before))
    assert [a.seq for a in second] == list(range(len(second))) and second[-1].last
    assert len(second) > got_before
    assert [a.pcm16 for a in first] == [a.pcm16 for a in second[:got_before]]


def test_sigterm_drains_then_exits_zero(broker, start_bridge) -> None:  # type: ignore[no-untyped-def]
    bridge = start_bridge(SINE_MODEL)
    device = Device(broker.url, "kitchen")
    try:
        answer = device.send(CloudRequest(id="term", text="x {chunks=10} {delay_ms=100}", model_version="1"))
        assert wait_for(lambda: len(answer.audio) >= 1, 15)
        bridge.signal(signal.SIGTERM)
        assert bridge.wait(15) == 0
        assert answer.finished.wait(5)
    finally:
        device.close()
    assert answer.done is not None and len(answer.audio) == 10
    assert "bridge stopped (drained)" in bridge.log.read_text()
