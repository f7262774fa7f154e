"""Cloud fixtures: a real tritonserver (nvidia-pytriton's, from .venv-triton)
on loopback ports for the session, and bridges on the test's broker."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cloud_bridge.bridge import BridgeService
from cloud_bridge.settings import BridgeSettings, build_settings
from cloud_bridge.triton_launcher import (
    REPOSITORY,
    LaunchSettings,
    TritonError,
    TritonServer,
    find_server,
    set_parameters,
)
from tests.cloud_bridge.sine_engine import write_sine_bundle
from tests.support.broker import Broker, free_port

SINE_FACTORY = "tests.cloud_bridge.sine_engine:load_sine_engine"
SINE_MODEL = "sine"
V1_HZ, V2_HZ = 440.0, 660.0


def _sine_model(repo: Path, root: Path) -> None:
    """A copy of the cosyvoice2 orchestrator named `sine` whose engine is the
    sine fixture: version 1 at 440 Hz, version 2 at 660 Hz (a chunk tells
    its version), with text directives that set its timing."""
    model = repo / SINE_MODEL
    shutil.copytree(REPOSITORY / "cosyvoice2", model, ignore=shutil.ignore_patterns("__pycache__", "bundle"))
    config = (model / "config.pbtxt").read_text().replace('name: "cosyvoice2"', f'name: "{SINE_MODEL}"')
    (model / "config.pbtxt").write_text(set_parameters(config, {"ENGINE_FACTORY": SINE_FACTORY}))
    for version, hz in (("1", V1_HZ), ("2", V2_HZ)):
        (model / version / "bundle").symlink_to(write_sine_bundle(root / f"sine-v{version}", hz))


@pytest.fixture(scope="session")
def triton(tiny_bundle: Path) -> Iterator[TritonServer]:
    """tritonserver on loopback with the product's cosyvoice2 model (the
    orchestrator over the tiny bundle, versions 1 and 2) and the `sine`
    model (the same orchestrator over the sine fixture engine)."""
    try:
        dist = find_server()
    except TritonError as exc:
        print(f"cloud tests skipped: {exc}")
        pytest.skip(str(exc))
    with tempfile.TemporaryDirectory(prefix="cosyedge-triton-test-") as tmp:
        root = Path(tmp)
        repo = root / "repository"
        shutil.copytree(REPOSITORY, repo, ignore=shutil.ignore_patterns("__pycache__", "bundle"))
        _sine_model(repo, root)
        settings = LaunchSettings(
            bundle=tiny_bundle,
            repository=repo,
            extra_models=(SINE_MODEL,),
            grpc_port=free_port(),
            http_port=free_port(),
            metrics_port=free_port(),
            workdir=root / "work",
            log_file=root / "tritonserver.log",
            exit_timeout_s=2,
            ready_timeout_s=300.0,
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
        "triton": {"url": server.grpc_url, "model": SINE_MODEL, "first_chunk_timeout_s": 20.0, "chunk_timeout_s": 20.0},
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
