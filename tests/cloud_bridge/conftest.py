"""Cloud fixtures: a real tritonserver (nvidia-pytriton's, from .venv-triton)
on loopback ports for the session, and bridges on the test's broker."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cosyedge_cloud.bridge.service import BridgeService
from cosyedge_cloud.bridge.settings import BridgeSettings, build_settings
from cosyedge_cloud.triton.launcher import (
    REPOSITORY,
    LaunchSettings,
    TritonError,
    TritonServer,
    find_server,
    set_parameters,
)

from tests.support.broker import Broker, free_port
from tests.support.components import missing, require_binary
from tests.support.fake_synthesizer import write_sine_bundle

TEMPLATES = Path(__file__).resolve().parents[2] / "systemd" / "mosquitto"
USERS = {"cosyedge-bridge": "bridge-secret", "devA": "a-secret", "devB": "b-secret"}
SINE_FACTORY = "tests.support.fake_synthesizer:load_sine_synthesizer"
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
        missing(f"tritonserver is not available: {exc}")
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
            missing(f"tritonserver did not start: {exc}")
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


@pytest.fixture()
def cloud_broker() -> Iterator[Broker]:
    """Mosquitto with authentication and the cloud ACL template."""
    require_binary("mosquitto", "apt-get install mosquitto")
    require_binary("mosquitto_passwd", "apt-get install mosquitto")
    with tempfile.TemporaryDirectory(prefix="cosyedge-cloud-mqtt-") as tmp:
        work = Path(tmp)
        work.chmod(0o755)  # mosquitto started as root reads its files after dropping to its own user
        passwd = work / "passwd"
        for i, (user, password) in enumerate(USERS.items()):
            args = ["mosquitto_passwd", "-b"] + (["-c"] if i == 0 else []) + [str(passwd), user, password]
            subprocess.run(args, check=True, capture_output=True)
        acl = work / "cosyedge-cloud.acl"
        acl.write_text((TEMPLATES / "cosyedge-cloud.acl").read_text())
        passwd.chmod(0o644)
        broker = Broker(work)
        broker.conf.write_text(
            f"listener {broker.port} 127.0.0.1\nallow_anonymous false\n"
            f"password_file {passwd}\nacl_file {acl}\n"
            f"set_tcp_nodelay true\npersistence true\npersistence_location {work}/\n"
        )
        broker.start()
        try:
            yield broker
        finally:
            broker.stop()


@pytest.fixture()
def cloud_bridge(cloud_broker: Broker, triton: TritonServer) -> Iterator[BridgeService]:
    settings = bridge_settings(
        cloud_broker, triton, mqtt={"username": "cosyedge-bridge", "password": USERS["cosyedge-bridge"]}
    )
    service = BridgeService(settings)
    service.start()
    assert service.wait_subscribed(10), "the bridge user could not subscribe (ACL?)"
    yield service
    service.stop(drain_timeout_s=2)


def device_broker_conf(cloud: Broker, device_id: str) -> str:
    """A device's Mosquitto bridged to `cloud` with the template of systemd/mosquitto/."""
    text = (TEMPLATES / "cosyedge-bridge.conf").read_text()
    return (
        text.replace("DEVICE_ID", device_id)
        .replace("cloud.example.com:8883", f"127.0.0.1:{cloud.port}")
        .replace("CHANGE_ME", USERS[device_id])
        .replace("restart_timeout 2 30", "restart_timeout 1 2")
    )
