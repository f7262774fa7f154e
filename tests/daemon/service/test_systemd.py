"""The files in systemd/: the unit passes `systemd-analyze verify`, the
sysusers/tmpfiles snippets apply to a scratch root, and the Mosquitto
configuration starts a broker whose ACLs keep devices apart."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from cosyedge_cloud.wire.mqtt import MqttOptions, connect, make_client
from paho.mqtt.enums import CallbackAPIVersion

from tests.support.broker import free_port, wait_for_port
from tests.support.components import require_binary

ROOT = Path(__file__).resolve().parents[3]
SYSTEMD = ROOT / "systemd"


def _need(tool: str) -> str:
    return require_binary(tool, "apt-get install systemd")


def test_unit_verifies(tmp_path: Path) -> None:
    tool = _need("systemd-analyze")
    unit = tmp_path / "cosyedge.service"
    shutil.copy(SYSTEMD / "cosyedge.service", unit)
    out = subprocess.run([tool, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "cosyedge.service" not in out.stderr, out.stderr  # no warnings about our unit
    text = unit.read_text()
    for line in (
        "Type=notify",
        "NotifyAccess=main",
        "WatchdogSec=",
        "Restart=on-failure",
        "User=cosyedge",
        "SupplementaryGroups=audio video",
        "StateDirectory=cosyedge",
        "CacheDirectory=cosyedge",
        "ProtectSystem=strict",
        "NoNewPrivileges=yes",
        "ExecReload=",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
    ):
        assert line in text, line
    assert not re.search(r"^PrivateDevices=", text, re.M)  # would hide the GPU and ALSA devices
    stop = int(re.search(r"^TimeoutStopSec=(\d+)", text, re.M).group(1))  # type: ignore[union-attr]
    from cosyedge_daemon.settings.schema import HealthSettings

    assert stop > HealthSettings().stop_timeout_s  # the drain finishes before systemd kills


def test_sysusers_and_tmpfiles_apply(tmp_path: Path) -> None:
    sysusers, tmpfiles = _need("systemd-sysusers"), _need("systemd-tmpfiles")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    conf = tmp_path / "cosyedge-sysusers.conf"
    shutil.copy(SYSTEMD / "cosyedge.sysusers", conf)
    subprocess.run([sysusers, f"--root={root}", str(conf)], check=True, capture_output=True, timeout=60)
    passwd = (root / "etc/passwd").read_text()
    group = (root / "etc/group").read_text()
    assert re.search(r"^cosyedge:x:\d+:\d+:[^:]*:/var/lib/cosyedge:", passwd, re.M)
    assert re.search(r"^audio:x:\d+:cosyedge$", group, re.M) and re.search(
        r"^video:x:\d+:cosyedge$", group, re.M
    )
    tconf = tmp_path / "cosyedge-tmpfiles.conf"
    shutil.copy(SYSTEMD / "cosyedge.tmpfiles", tconf)
    subprocess.run(
        [tmpfiles, f"--root={root}", "--create", str(tconf)], check=True, capture_output=True, timeout=60
    )
    uid = int(re.search(r"^cosyedge:x:(\d+):", passwd, re.M).group(1))  # type: ignore[union-attr]
    for d in ("var/lib/cosyedge/bundles", "var/cache/cosyedge"):
        st = (root / d).stat()
        assert st.st_uid == uid and oct(st.st_mode & 0o777) == "0o750", d


def _client(port: int, user: str, password: str) -> tuple[mqtt.Client, list[str]]:
    got: list[str] = []
    opts = MqttOptions(broker=f"mqtt://127.0.0.1:{port}", client_id=f"{user}-{uuid.uuid4().hex[:6]}",
                       username=user, password=password)
    c = make_client(opts)
    connected = threading.Event()
    c.on_connect = lambda *_a: connected.set()
    c.on_message = lambda _c, _u, m: got.append(m.topic)
    connect(c, opts)
    c.loop_start()
    assert connected.wait(5)
    return c, got


@pytest.fixture()
def readable_dir() -> Iterator[Path]:
    """A scratch directory the mosquitto user can read (mosquitto started as
    root drops to its own user before it opens the password file)."""
    path = Path(tempfile.mkdtemp(prefix="cosyedge-mq-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_mosquitto_config_starts_and_acls_separate_devices(readable_dir: Path) -> None:
    binary = require_binary("mosquitto", "apt-get install mosquitto")
    require_binary("mosquitto_passwd", "apt-get install mosquitto")
    port = free_port()
    tmp_path = readable_dir
    conf_d = tmp_path / "conf.d"
    conf_d.mkdir()
    passwd, acl = tmp_path / "cosyedge.passwd", tmp_path / "cosyedge.acl"
    for user in ("dev1", "dev2", "app"):
        args = ["mosquitto_passwd", "-b"] + (["-c"] if user == "dev1" else []) + [str(passwd), user, "pw"]
        subprocess.run(args, check=True, capture_output=True)
    os.chmod(passwd, 0o644)
    shutil.copy(SYSTEMD / "mosquitto" / "cosyedge.acl", acl)
    ours = (SYSTEMD / "mosquitto" / "cosyedge.conf").read_text()
    ours = ours.replace("listener 1883\n", f"listener {port} 127.0.0.1\n")
    ours = ours.replace("/etc/mosquitto/cosyedge.passwd", str(passwd)).replace(
        "/etc/mosquitto/cosyedge.acl", str(acl)
    )
    (conf_d / "cosyedge.conf").write_text(ours)
    # Debian's main mosquitto.conf, pointed at the scratch directory.
    main = tmp_path / "mosquitto.conf"
    main.write_text(f"persistence true\npersistence_location {tmp_path}/\ninclude_dir {conf_d}\n")
    log = (tmp_path / "log").open("wb")
    proc = subprocess.Popen([binary, "-c", str(main)], stdout=log, stderr=subprocess.STDOUT)
    try:
        try:
            wait_for_port(port, 10)
        except TimeoutError:
            pytest.fail((tmp_path / "log").read_text())
        dev1, got1 = _client(port, "dev1", "pw")
        dev2, got2 = _client(port, "dev2", "pw")
        app, _ = _client(port, "app", "pw")
        dev1.subscribe("cosyedge/#", qos=1)
        dev2.subscribe("cosyedge/dev1/#", qos=1)  # not its tree: the broker will not deliver
        app.subscribe("cosyedge/+/tts/#", qos=1)
        time.sleep(0.3)
        app.publish("cosyedge/dev1/tts/say", "{}", qos=1).wait_for_publish(5)
        dev2.publish("cosyedge/dev1/tts/say", "{}", qos=1).wait_for_publish(5)  # denied (dropped)
        dev1.publish("cosyedge/dev1/tts/done/x", "{}", qos=1).wait_for_publish(5)
        time.sleep(0.5)
        assert got1.count("cosyedge/dev1/tts/say") == 1  # the app's, not dev2's
        assert got2 == []
        for c in (dev1, dev2, app):
            c.disconnect()
            c.loop_stop()
        bad = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        refused = threading.Event()
        bad.on_connect = lambda _c, _u, _f, rc, _p: refused.set() if rc.is_failure else None
        bad.connect("127.0.0.1", port)  # anonymous
        bad.loop_start()
        assert refused.wait(5)
        bad.loop_stop()
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
