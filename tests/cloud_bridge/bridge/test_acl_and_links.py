"""Authorization and the broker topology: the cloud broker with password
and ACL files (the template in systemd/mosquitto/), devices that cannot read
each other's responses, and a device broker bridged to the cloud broker with
the bridge template."""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from cosyedge_cloud.bridge.service import BridgeService
from cosyedge_cloud.wire.protocol import CloudRequest

from tests.cloud_bridge.conftest import USERS, bridge_settings, device_broker_conf
from tests.cloud_bridge.device import Device
from tests.support.broker import Broker, running_broker
from tests.support.components import require_binary
from tests.support.waiting import wait_for


def _device(broker: Broker, user: str, **kw: object) -> Device:
    return Device(broker.url, user, username=user, password=USERS[user], **kw)  # type: ignore[arg-type]


def test_a_device_cannot_read_another_devices_responses(cloud_broker, cloud_bridge) -> None:  # type: ignore[no-untyped-def]
    a = _device(cloud_broker, "devA")
    b = _device(cloud_broker, "devB")
    try:
        # devA listens where devB's answers go: Mosquitto may grant the subscription, but delivers nothing
        a.subscribe("cosyedge/devB/cloud/response/+")
        a.subscribe("cosyedge/+/cloud/response/#")
        answer_b = b.ask(CloudRequest(id="secret", text="for b only {chunks=2}", model_version="1"))
        # devA claims to be devB in the payload: refused, answered on devA's own topic
        spoof = a.ask(CloudRequest(id="spoof", text="hi", device_id="devB"))
        # devA writes on devB's request topic: the broker refuses the publish, the bridge never sees it
        a.client.publish("cosyedge/devB/cloud/request", CloudRequest(id="forged", text="hi").to_json(), qos=1)
        own = a.ask(CloudRequest(id="mine", text="hi", model_version="1"))
        time.sleep(0.3)
    finally:
        a.close()
        b.close()
    assert answer_b.done is not None and len(answer_b.audio) == 2
    assert spoof.error is not None and spoof.error.code == "device_mismatch"
    assert own.done is not None
    assert "secret" not in a.answers and not [t for t, _ in a.stray if "devB" in t]
    assert set(b.answers) == {"secret"}  # nothing of devA's (and no forged request) reached devB
    assert cloud_bridge.metrics.value("cosyedge_bridge_requests_total", version="1", outcome="done") == 2


def test_wrong_password_is_refused(cloud_broker) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConnectionRefusedError, match="Not authorized|Bad user name or password"):
        Device(cloud_broker.url, "devA", username="devA", password="wrong")


def test_through_a_device_broker_bridged_to_the_cloud(cloud_broker, cloud_bridge) -> None:  # type: ignore[no-untyped-def]
    with running_broker(extra_conf=device_broker_conf(cloud_broker, "devA")) as local:
        device = Device(local.url, "devA")  # the daemon talks to its local broker only, anonymously here
        try:
            # the bridge's notification topic says when the link is up (retained "1")
            assert wait_for(lambda: _link_state(local) == b"1", 10), "the device broker's bridge is not up"
            answer = device.ask(CloudRequest(id="via-link", text="over the bridge {chunks=3}", model_version="1"))
        finally:
            device.close()
    assert answer.done is not None, answer.error
    # MQTT v5 across the link: the chunk facts come from user properties, not from a header
    assert [(a.seq, a.last, a.model_version) for a in answer.audio] == [
        (0, False, "1"),
        (1, False, "1"),
        (2, True, "1"),
    ]


def _link_state(local: Broker) -> bytes | None:
    import paho.mqtt.subscribe as subscribe

    try:
        msg = subscribe.simple(
            "cosyedge/devA/cloud/link",
            hostname="127.0.0.1",
            port=local.port,
            retained=True,
            msg_count=1,
            keepalive=5,
        )
    except Exception:
        return None
    return msg.payload if msg is not None else None  # type: ignore[union-attr]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _make_certs(work: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1."""
    ca_key, ca, key, csr, cert = (work / n for n in ("ca.key", "ca.crt", "server.key", "server.csr", "server.crt"))
    ext = work / "san.ext"
    ext.write_text("subjectAltName = IP:127.0.0.1\n")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(ca_key),
        "-out",
        str(ca),
        "-days",
        "1",
        "-subj",
        "/CN=cosyedge test CA",
    )
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")
    _openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-out",
        str(cert),
        "-days",
        "1",
        "-extfile",
        str(ext),
    )
    for f in (ca, key, cert):
        f.chmod(0o644)
    return ca, cert, key


def test_tls_between_bridge_broker_and_device(triton, capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    from cosyedge_cloud.tools.probe import main as probe_main

    require_binary("openssl", "apt-get install openssl")
    require_binary("mosquitto", "apt-get install mosquitto")
    with tempfile.TemporaryDirectory(prefix="cosyedge-tls-") as tmp:
        work = Path(tmp)
        work.chmod(0o755)
        ca, cert, key = _make_certs(work)
        broker = Broker(work)
        broker.conf.write_text(
            f"listener {broker.port} 127.0.0.1\nallow_anonymous true\ncafile {ca}\ncertfile {cert}\n"
            f"keyfile {key}\nset_tcp_nodelay true\n"
        )
        broker.start()
        try:
            settings = bridge_settings(
                broker, triton, mqtt={"broker": f"mqtts://127.0.0.1:{broker.port}", "tls_ca_file": str(ca)}
            )
            service = BridgeService(settings)
            service.start()
            try:
                assert service.wait_subscribed(10), "the bridge did not connect over TLS"
                code = probe_main(
                    [
                        "hi {chunks=2}",
                        "--broker",
                        f"mqtts://127.0.0.1:{broker.port}",
                        "--ca-file",
                        str(ca),
                        "--model-version",
                        "1",
                        "--timeout-s",
                        "30",
                    ]
                )
                report = json.loads(capsys.readouterr().out)
            finally:
                service.stop(drain_timeout_s=2)
        finally:
            broker.stop()
    assert code == 0, report
    assert report["chunks"] == 2
