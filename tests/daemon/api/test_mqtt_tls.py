"""The daemon on a Mosquitto that requires TLS and a password: mqtts://, the
CA file, the user name and password_file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from cosyedge_cloud.wire.mqtt import MqttOptions, connect, make_client
from cosyedge_daemon.service.service import Service

from tests.daemon.conftest import SynthesizerFactory, make_settings
from tests.support.broker import free_port, wait_for_port
from tests.support.components import require_binary


@pytest.fixture()
def tls_broker() -> Iterator[tuple[int, Path]]:
    binary = require_binary("mosquitto", "apt-get install mosquitto")
    require_binary("mosquitto_passwd", "apt-get install mosquitto")
    require_binary("openssl", "apt-get install openssl")
    work = Path(tempfile.mkdtemp(prefix="cosyedge-tls-"))
    os.chmod(work, 0o755)  # mosquitto started as root reads its files as user mosquitto
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(work / "server.key"),
            "-out",
            str(work / "server.crt"),
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        ["mosquitto_passwd", "-c", "-b", str(work / "passwd"), "dev-tls", "s3cret"],
        check=True,
        capture_output=True,
    )
    for f in ("server.key", "passwd"):
        os.chmod(work / f, 0o644)
    port = free_port()
    (work / "m.conf").write_text(
        f"listener {port} 127.0.0.1\ncertfile {work}/server.crt\nkeyfile {work}/server.key\n"
        f"allow_anonymous false\npassword_file {work}/passwd\nset_tcp_nodelay true\n"
    )
    log = (work / "log").open("wb")
    proc = subprocess.Popen([binary, "-c", str(work / "m.conf")], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port)
        yield port, work
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
        shutil.rmtree(work, ignore_errors=True)


def test_tls_and_password(tls_broker: tuple[int, Path], engine_factory: SynthesizerFactory) -> None:
    port, work = tls_broker
    (work / "pw").write_text("s3cret\n")
    settings = make_settings(
        f"mqtts://localhost:{port}",
        device_id="dev-tls",
        mqtt={
            "tls_ca_file": str(work / "server.crt"),
            "username": "dev-tls",
            "password_file": str(work / "pw"),
        },
    )
    svc = Service(settings)
    svc.set_synthesizers(engine_factory(), None)
    svc.start(connect_timeout_s=10)
    try:
        assert svc.conn.connected.is_set()
        got: list[mqtt.MQTTMessage] = []
        done = threading.Event()
        opts = MqttOptions(broker=f"mqtts://localhost:{port}", tls_ca_file=str(work / "server.crt"),
                           username="dev-tls", password="s3cret")
        c = make_client(opts)

        def on_message(_c: object, _u: object, m: mqtt.MQTTMessage) -> None:
            got.append(m)
            if "/tts/done/" in m.topic:
                done.set()

        c.on_message = on_message
        c.on_connect = lambda cl, *_: cl.subscribe("cosyedge/dev-tls/#", qos=1)
        connect(c, opts)
        c.loop_start()
        c.publish(
            "cosyedge/dev-tls/tts/say",
            json.dumps({"id": "t", "text": "Over TLS.", "output": "publish"}),
            qos=1,
        )
        assert done.wait(10)
        assert json.loads(next(m for m in got if m.topic.endswith("done/t")).payload)["reason"] == "completed"
        assert any(m.topic == "cosyedge/dev-tls/status" and m.payload == b"online" for m in got)
        c.disconnect()
        c.loop_stop()
    finally:
        svc.stop(timeout_s=1)


def test_wrong_password_is_refused(tls_broker: tuple[int, Path], engine_factory: SynthesizerFactory) -> None:
    port, work = tls_broker
    settings = make_settings(
        f"mqtts://localhost:{port}",
        device_id="dev-tls",
        mqtt={"tls_ca_file": str(work / "server.crt"), "username": "dev-tls", "password": "wrong"},
    )
    svc = Service(settings)
    svc.set_synthesizers(engine_factory(), None)
    svc.start(connect_timeout_s=1.5)
    try:
        assert not svc.conn.connected.is_set()
    finally:
        svc.stop(timeout_s=0.5)
