"""The shipped ACL (systemd/mosquitto/cosyedge.acl) with the shipped broker
configuration on a real Mosquitto, a password file for two devices (devA
serves Hermes, as the ACL's Hermes block grants it; devB does not) and an
application user: exactly what each may publish and read, Hermes included."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from tests.support.mqtt_recorder import Recorder
from tests.support.shipped_broker import ShippedBroker, shipped_broker

USERS = {"devA": "pw-a", "devB": "pw-b", "app": "pw-app", "admin": "pw-admin"}

# (publisher, topic, allowed)
PUBLISH = [
    ("devA", "cosyedge/devA/tts/done/r1", True),
    ("devA", "cosyedge/devA/status", True),
    ("devA", "cosyedge/devB/tts/say", False),
    ("devA", "cosyedge/devB/status", False),
    ("devB", "cosyedge/devA/tts/say", False),
    ("devB", "cosyedge/devA/admin/reload", False),
    ("app", "cosyedge/devA/tts/say", True),
    ("app", "cosyedge/devB/tts/cancel", True),
    ("app", "cosyedge/devA/admin/reload", False),
    ("app", "cosyedge/devA/status", False),
    ("app", "cosyedge/devA/tts/done/r1", False),
    ("admin", "cosyedge/devA/admin/reload", True),
    # Hermes
    ("app", "hermes/tts/say", True),
    ("devA", "hermes/tts/say", False),
    ("devA", "hermes/tts/sayFinished", True),
    ("devA", "hermes/error/tts", True),
    ("devB", "hermes/tts/sayFinished", False),
    ("devB", "hermes/error/tts", False),
    ("app", "hermes/tts/sayFinished", False),
    ("devA", "hermes/audioServer/devA/playBytes/p1", True),
    ("devA", "hermes/audioServer/devB/playBytes/p1", False),
    ("devB", "hermes/voiceActivity/devB/vadUp", True),
    ("devB", "hermes/voiceActivity/devA/vadUp", False),
]

# (reader, topic, allowed): admin publishes, the reader subscribed to "#"
READ = [
    ("devA", "cosyedge/devA/tts/say", True),
    ("devA", "cosyedge/devB/tts/say", False),
    ("devA", "cosyedge/devB/tts/done/r1", False),
    ("devB", "cosyedge/devA/status", False),
    ("devA", "hermes/tts/say", True),
    ("devB", "hermes/tts/say", True),
    ("devA", "hermes/tts/sayFinished", False),
    ("app", "cosyedge/devA/tts/done/r1", True),
    ("app", "cosyedge/devB/tts/audio/r1", True),
    ("app", "cosyedge/devA/status", True),
    ("app", "cosyedge/devA/vad/event", True),
    ("app", "cosyedge/devA/admin/reload", False),
    ("app", "cosyedge/devA/cloud/request", False),
    ("app", "hermes/tts/sayFinished", True),
    ("app", "hermes/error/tts", True),
    ("app", "hermes/audioServer/devA/playBytes/p1", False),
]


# A topic each user may publish to and one each may read: sent last, their arrival shows that
# everything sent before by the same client has been delivered or dropped (MQTT keeps the order
# of one publisher's messages to a subscriber), so no test waits for a time.
LAST_PUBLISH = {"devA": "cosyedge/devA/status", "devB": "hermes/voiceActivity/devB/vadUp",
                "app": "cosyedge/devA/tts/say", "admin": "cosyedge/devA/admin/reload"}
LAST_READ = {"devA": "cosyedge/devA/tts/say", "devB": "hermes/tts/say", "app": "cosyedge/devA/status"}


def _client(port: int, user: str) -> Recorder:
    return Recorder(f"mqtt://127.0.0.1:{port}", ["#"], username=user, password=USERS[user], name=user)


@pytest.fixture(scope="module")
def broker() -> Iterator[ShippedBroker]:
    with shipped_broker(USERS, hermes_devices=("devA",)) as b:
        yield b


def _clients(broker: ShippedBroker) -> dict[str, Recorder]:
    return {u: _client(broker.port, u) for u in USERS}


def test_what_each_user_may_publish(broker: ShippedBroker) -> None:
    clients = _clients(broker)
    try:
        for n, (user, topic, _) in enumerate(PUBLISH):
            clients[user].publish(topic, f"pub-{n}")
        for user, topic in LAST_PUBLISH.items():
            clients[user].publish(topic, f"end-{user}")
        admin = clients["admin"]
        assert admin.wait(lambda: all(f"end-{u}".encode() in admin.payloads() for u in LAST_PUBLISH), 10)
        seen = admin.payloads()
        delivered = [(u, t, f"pub-{n}".encode() in seen) for n, (u, t, _) in enumerate(PUBLISH)]
    finally:
        for c in clients.values():
            c.close()
    assert delivered == PUBLISH


def test_what_each_user_may_read(broker: ShippedBroker) -> None:
    clients = _clients(broker)
    try:
        for n, (_, topic, _) in enumerate(READ):
            clients["admin"].publish(topic, f"read-{n}")
        for user, topic in LAST_READ.items():
            clients["admin"].publish(topic, f"end-{user}")
        for user in LAST_READ:
            assert clients[user].wait(lambda u=user: f"end-{u}".encode() in clients[u].payloads(), 10), user
        got = {u: c.payloads() for u, c in clients.items()}
        received = [(u, t, f"read-{n}".encode() in got[u]) for n, (u, t, _) in enumerate(READ)]
    finally:
        for c in clients.values():
            c.close()
    assert received == READ


def test_anonymous_and_wrong_password_refused(broker: ShippedBroker) -> None:
    for user, password in ((None, None), ("devA", "wrong")):
        c = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        if user:
            c.username_pw_set(user, password)
        refused = threading.Event()
        c.on_connect = lambda _c, _u, _f, rc, _p, ev=refused: ev.set() if rc.is_failure else None
        c.connect("127.0.0.1", broker.port)
        c.loop_start()
        try:
            assert refused.wait(5), f"{user or 'anonymous'} was let in"
        finally:
            c.loop_stop()
