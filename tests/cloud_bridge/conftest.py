"""Cloud fixtures: a real tritonserver (nvidia-pytriton's, from .venv-triton)
on loopback ports for the session, and bridges on the test's broker."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cloud_bridge.bridge import BridgeService
from cloud_bridge.settings import BridgeSettings, build_settings
from cloud_bridge.triton_launcher import LaunchSettings, TritonError, TritonServer, find_server
from tests.cloud_bridge.sine_engine import write_sine_bundle
from tests.support.broker import Broker, free_port

SINE_FACTORY = "tests.cloud_bridge.sine_engine:load_sine_engine"
V1_HZ, V2_HZ = 440.0, 660.0


@pytest.fixture(scope="session")
def triton() -> Iterator[TritonServer]:
    """tritonserver with the cosyvoice2 orchestrator over sine-tone engines:
    version 1 at 440 Hz, version 2 at 660 Hz (so a chunk tells its version)."""
    try:
        dist = find_server()
    except TritonError as exc:
        print(f"cloud tests skipped: {exc}")
        pytest.skip(str(exc))
    with tempfile.TemporaryDirectory(prefix="cosyedge-triton-test-") as tmp:
        root = Path(tmp)
        settings = LaunchSettings(
            bundle=write_sine_bundle(root / "v1", V1_HZ),
            version_bundles={"2": write_sine_bundle(root / "v2", V2_HZ)},
            parameters={"ENGINE_FACTORY": SINE_FACTORY},
            grpc_port=free_port(),
            http_port=free_port(),
            metrics_port=free_port(),
            workdir=root / "work",
            log_file=root / "tritonserver.log",
            exit_timeout_s=2,
        )
        server = TritonServer(settings, dist)
        try:
            server.start()
        except TritonError as exc:
            print(f"cloud tests skipped: tritonserver did not start: {exc}")
            pytest.skip(f"tritonserver did not start: {exc}")
        try:
            yield server
        finally:
            server.stop()


def bridge_settings(broker: Broker, server: TritonServer, **sections: dict) -> BridgeSettings:  # type: ignore[type-arg]
    doc: dict = {  # type: ignore[type-arg]
        "mqtt": {"broker": broker.url, "client_id": f"bridge-{broker.port}"},
        "triton": {"url": server.grpc_url, "first_chunk_timeout_s": 20.0, "chunk_timeout_s": 20.0},
        "limits": {"drain_timeout_s": 10.0},
        "metrics": {"port": 0},
    }
    for name, values in sections.items():
        doc.setdefault(name, {}).update(values)
    return build_settings(doc)


@pytest.fixture()
def make_bridge(broker: Broker, triton: TritonServer) -> Iterator[Callable[..., BridgeService]]:
    started: list[BridgeService] = []

    def make(**sections: dict) -> BridgeService:  # type: ignore[type-arg]
        service = BridgeService(bridge_settings(broker, triton, **sections))
        service.start()
        assert service.wait_subscribed(10), "the bridge did not subscribe"
        started.append(service)
        return service

    yield make
    for service in started:
        service.stop(drain_timeout_s=2.0)
