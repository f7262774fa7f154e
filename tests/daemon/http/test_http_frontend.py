"""The HTTP front end as part of the daemon: `cosyedge doctor` sees it
(off, free, answering, taken by something else), the health document
counts its requests, and it stops with the daemon."""

from __future__ import annotations

import socket
from dataclasses import replace

from cosyedge_daemon.cli.doctor import check_http

from tests.daemon.conftest import DaemonFactory
from tests.daemon.http.conftest import client, start
from tests.support.waiting import wait_until


def test_doctor_and_health(daemons: DaemonFactory) -> None:
    svc = start(daemons)
    assert svc.http is not None
    port = svc.http.port
    assert client(svc).audio.speech.create(model="cosyedge", voice="alloy", input="Hi.",
                                           response_format="pcm").content
    wait_until(lambda: svc.health_doc()["http"]["in_progress"] == 0)  # the handler ends after the client has all
    health = svc.health_doc()["http"]
    assert (health["served"], health["in_progress"], health["listen"]) == (1, 0, f"127.0.0.1:{port}")
    assert svc.liveness()["http"]

    def check(listen: str) -> tuple[bool, str]:
        c = check_http(replace(svc.settings, http=replace(svc.settings.http, listen=listen)))
        return c.ok, c.detail

    ok, detail = check(f"127.0.0.1:{port}")
    assert ok and "answering" in detail and "cosyedge" in detail
    assert check("")[0] and "off" in check("")[1]
    with socket.socket() as other:  # something else holds a port: it never answers HTTP
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        ok, detail = check(f"127.0.0.1:{other.getsockname()[1]}")
        assert not ok and "does not answer" in detail
        free = other.getsockname()[1]
    ok, detail = check(f"127.0.0.1:{free}")
    assert ok and "free" in detail
    svc.stop(timeout_s=1)
    assert not svc.http.alive()
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # the listener is gone with the daemon
