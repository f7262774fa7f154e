"""The shipped Mosquitto configuration (systemd/mosquitto/cosyedge.conf and
cosyedge.acl) on a free loopback port, with a password file of our own
users, as Debian runs it (its main mosquitto.conf includes conf.d/)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.broker import free_port, wait_for_port
from tests.support.components import require_binary

SYSTEMD = Path(__file__).resolve().parents[2] / "systemd"
HERMES_EXAMPLE_USER = "kitchen"  # the commented example block in cosyedge.acl


def hermes_grant(acl_text: str, device: str) -> str:
    """The ACL's commented Hermes block, uncommented for `device`."""
    block = [line[1:] for line in acl_text.splitlines()
             if line.startswith(f"#user {HERMES_EXAMPLE_USER}") or line.startswith("#topic write hermes/")]
    if not block or not block[0].startswith("user "):
        raise AssertionError("cosyedge.acl lost its commented Hermes block")
    return "\n".join(block).replace(f"user {HERMES_EXAMPLE_USER}", f"user {device}") + "\n"


@dataclass
class ShippedBroker:
    port: int
    workdir: Path

    @property
    def log(self) -> str:
        return (self.workdir / "log").read_text(errors="replace")


@contextmanager
def shipped_broker(users: dict[str, str], hermes_devices: tuple[str, ...] = ()) -> Iterator[ShippedBroker]:
    binary = require_binary("mosquitto", "apt-get install mosquitto")
    require_binary("mosquitto_passwd", "apt-get install mosquitto")
    work = Path(tempfile.mkdtemp(prefix="cosyedge-acl-"))
    os.chmod(work, 0o755)  # mosquitto started as root reads its files as user mosquitto
    try:
        port = free_port()
        passwd, acl = work / "cosyedge.passwd", work / "cosyedge.acl"
        for n, (user, password) in enumerate(users.items()):
            args = ["mosquitto_passwd", "-b", *(["-c"] if n == 0 else []), str(passwd), user, password]
            subprocess.run(args, check=True, capture_output=True)
        os.chmod(passwd, 0o644)
        acl_text = (SYSTEMD / "mosquitto" / "cosyedge.acl").read_text()
        acl.write_text(acl_text + "".join(hermes_grant(acl_text, d) for d in hermes_devices))
        conf = (SYSTEMD / "mosquitto" / "cosyedge.conf").read_text()
        conf = conf.replace("listener 1883\n", f"listener {port} 127.0.0.1\n")
        conf = conf.replace("/etc/mosquitto/cosyedge.passwd", str(passwd))
        conf = conf.replace("/etc/mosquitto/cosyedge.acl", str(acl))
        (work / "conf.d").mkdir()
        (work / "conf.d" / "cosyedge.conf").write_text(conf)
        main = work / "mosquitto.conf"
        main.write_text(f"persistence true\npersistence_location {work}/\ninclude_dir {work / 'conf.d'}\n")
        with (work / "log").open("wb") as log:
            proc = subprocess.Popen([binary, "-c", str(main)], stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for_port(port, 10)
            yield ShippedBroker(port, work)
        finally:
            proc.terminate()
            proc.wait(10)
    finally:
        shutil.rmtree(work, ignore_errors=True)
