"""The id policy and the ResponseTopic policy at their boundaries."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from cosyedge_daemon.api.request_policy import ResponseTopicPolicy
from cosyedge_daemon.request.ids import leading_id, valid_id
from cosyedge_daemon.settings.topics import NativeTopics, topic_problem

ALPHABET = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:@-")


def test_id_alphabet_is_exactly_the_documented_one() -> None:
    for code in range(0x3000):
        c = chr(code)
        assert valid_id(c) == (c in ALPHABET), repr(c)


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("a" * 128, True), ("a" * 129, False), ("", False), ("a\n", False), ("\na", False), ("a\r", False),
        ("a b", False), ("a/b", False), ("a+b", False), ("a#", False), ("é", False), ("١", False),
        ("x:y@z.w-_", True), (None, False), (5, False), (["a"], False),
    ],
)
def test_id_boundaries(value: object, ok: bool) -> None:
    assert valid_id(value) is ok


def test_leading_id() -> None:
    assert leading_id(b'  {"id" : "r-1", "text": broken') == "r-1"
    assert leading_id(b'{"text": "x", "id": "late"}') is None  # only at the very start
    assert leading_id(b'{"id": "a\\n"}') is None
    assert leading_id(b'{"id": "' + b"a" * 129 + b'"}') is None


OWN = ["cosyedge/d1/tts/say", "cosyedge/d1/tts/cancel", "cosyedge/d1/admin/reload", "hermes/tts/say",
       "cosyedge/d1/cloud/response/+"]


@pytest.mark.parametrize(
    ("topic", "prefix", "refused"),
    [
        ("replies/c1", "", False),
        ("a/+/b", "", True), ("a/#", "", True), ("+", "", True), ("", "", True),
        ("a/\nb", "", True), ("a/\x00", "", True), ("a/\x7f", "", True), ("a/\x85", "", True),
        ("x" * 65535, "", False), ("x" * 65536, "", True),
        ("cosyedge/d1/tts/say", "", True), ("hermes/tts/say", "", True),
        ("cosyedge/d1/cloud/response/r1", "", True),  # matched by a wildcard subscription
        ("cosyedge/d1/tts/say/x", "", False), ("cosyedge/d2/tts/say", "", False),
        ("apps", "apps", False), ("apps/c1", "apps", False), ("apps/c1/x", "apps", False),
        ("appsx", "apps", True), ("app", "apps", True), ("other/apps/c1", "apps", True),
        ("apps/c1", "apps/", False),
        # the namespaces the daemon speaks itself: refused by default, allowed by a prefix inside them
        ("hermes/tts/sayFinished", "", True), ("hermes", "", True), ("hermesx/a", "", False),
        ("cosyedge/d1/status", "", True), ("cosyedge/d1/status/health", "", True),
        ("cosyedge/d1/statusx", "", False), ("cosyedge/d2/status", "", False),
        ("hermes/replies/c1", "hermes/replies", False), ("hermes/tts/sayFinished", "hermes/replies", True),
        ("hermes/tts/say", "hermes", True),  # an input topic whatever the prefix
        ("cosyedge/d1/status/x", "cosyedge/d1/status", False),
    ],
)
def test_response_topic_boundaries(topic: str, prefix: str, refused: bool) -> None:
    problem = ResponseTopicPolicy(OWN, prefix, NativeTopics("cosyedge/d1").reserved()).problem(topic)
    assert (problem is not None) is refused, problem
    if problem:
        assert len(problem) < 400


def test_topic_problem_names_the_reason() -> None:
    assert topic_problem("a\nb") == "it contains a control character"
    assert topic_problem("a/+") == "it contains an MQTT wildcard (+ or #)"
    assert topic_problem("a/\ud800") == "it is not valid UTF-8"


def test_child_dies_with_its_parent_even_on_sigkill() -> None:
    """The mechanism that keeps `cosyedge triton` from orphaning tritonserver."""
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys, time\n"
         "from cosyedge_cloud.triton.proc_guard import die_with_parent\n"
         "c = subprocess.Popen(['sleep', '300'], preexec_fn=die_with_parent())\n"
         "print(c.pid, flush=True)\n"
         "time.sleep(300)\n"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        try:  # reaped by init, or a zombie until then
            with open(f"/proc/{child}/stat") as fh:
                if fh.read().split()[2] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the child outlived its SIGKILLed parent")


def test_device_id_with_a_trailing_newline_is_refused() -> None:
    """The device id becomes every topic's prefix (found by the config fuzz after `$` matched before \\n)."""
    from cosyedge_daemon.settings.loader import validate_device_id
    from cosyedge_models.settings_schema import ConfigError

    assert validate_device_id("kitchen-1") == "kitchen-1"
    for bad in ("kitchen\n", "kitchen\n\n", "\nkitchen", "a/b", "a" * 65):
        with pytest.raises(ConfigError):
            validate_device_id(bad)
