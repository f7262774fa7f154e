"""Child processes that must not outlive the process that started them: on
Linux the kernel sends the child a signal when its parent dies (also by
SIGKILL, when no cleanup code runs), via prctl(PR_SET_PDEATHSIG)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` for subprocess.Popen that makes the child receive `sig`
    when the parent thread ends; None where the kernel has no such call.
    Popen must be called from a thread that lives as long as the child
    should (the main thread of a command)."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()

    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            os._exit(127)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec
