"""One rule for tests that need a component which `.ci/setup` installs
(mosquitto, tritonserver, espeak-ng, systemd-analyze, the Hermes test
package): locally a missing component skips the test with the reason and
the fix; in CI (environment CI=true) it fails the test, so a broken setup
can never turn the run green by skipping."""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def missing(what: str) -> NoReturn:
    """Skip (locally) or fail (CI=true) because `what` (a sentence saying
    what is missing and how to install it) is not there."""
    if in_ci():
        pytest.fail(f"{what} -- CI=true: .ci/setup must provide it, so this fails instead of skipping",
                    pytrace=False)
    pytest.skip(what, allow_module_level=True)


def require_binary(name: str, install: str) -> str:
    """The path of executable `name`, else missing() with `install` (e.g. 'apt-get install mosquitto')."""
    path = shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/usr/local/sbin/{name}") if os.access(p, os.X_OK)), None
    )
    if path is None:
        missing(f"{name} is not installed ({install}; .ci/setup installs it)")
    return path
