"""Work started on several threads at once, for the tests that run concurrent requests."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_concurrently(n: int, work: Callable[[int], T], timeout_s: float = 600) -> dict[int, T]:
    """work(i) for i in 0..n-1, each on its own thread ("request-i"), all released together by a
    barrier; their results by i. Fails the test with every error raised."""
    outs: dict[int, T] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def one(i: int) -> None:
        try:
            start.wait()
            outs[i] = work(i)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,), name=f"request-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not errors, errors
    assert len(outs) == n, f"{n - len(outs)} of {n} threads did not finish in {timeout_s} s"
    return outs
