"""Waiting on a state, not for a time: the tests' one polling wait for what
has no event to wait on (a metric, another process's state). It only
bounds how long a test may hang; no assertion depends on how long it took."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], object], timeout_s: float = 10.0, interval_s: float = 0.01) -> bool:
    """True as soon as `predicate()` holds; False if it still does not after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def wait_until(predicate: Callable[[], object], timeout_s: float = 10.0) -> None:
    """wait_for that fails the test when the state is not reached."""
    assert wait_for(predicate, timeout_s), f"condition not reached in {timeout_s} s"
