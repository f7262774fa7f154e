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
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from tests.support.broker import free_port, wait_for_port
from tests.support.components import require_binary
from tests.support.mqtt_recorder import Recorder

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
        url = f"mqtt://127.0.0.1:{port}"
        dev1 = Recorder(url, ["cosyedge/#"], username="dev1", password="pw", name="dev1")
        # dev1's tree is not dev2's: the broker will not deliver it; its own tree shows when all has arrived
        dev2 = Recorder(url, ["cosyedge/dev1/#", "cosyedge/dev2/#"], username="dev2", password="pw", name="dev2")
        app = Recorder(url, ["cosyedge/+/tts/#"], username="app", password="pw", name="app")
        app.publish("cosyedge/dev1/tts/say", "{}")
        dev2.publish("cosyedge/dev1/tts/say", "{}")  # denied (dropped)
        dev1.publish("cosyedge/dev1/tts/done/x", "{}")
        # last messages (Mosquitto delivers in the order it took them): what came before has arrived
        dev1.publish("cosyedge/dev1/tts/done/end", "{}")
        app.publish("cosyedge/dev2/tts/say", "end")
        dev1.wait_topic("cosyedge/dev1/tts/done/end", 10)
        dev2.wait_topic("cosyedge/dev2/tts/say", 10)
        assert [m.topic for m in dev1.messages].count("cosyedge/dev1/tts/say") == 1  # the app's, not dev2's
        assert [m.topic for m in dev2.messages] == ["cosyedge/dev2/tts/say"]
        for c in (dev1, dev2, app):
            c.close()
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
