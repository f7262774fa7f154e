"""Hypothesis seeded per run: every run draws new examples (CI explores, it
does not replay the same derandomized ones), and the seed is printed in the
report header and with each failure so that the run can be replayed:
`COSYEDGE_HYPOTHESIS_SEED=N pytest ...` (or pytest's --hypothesis-seed=N).
The profile `cosyedge` replaces Hypothesis's own `ci` profile, which
derandomizes; no example database (the seed is the replay), no deadline (a
loaded two-core machine is not a test failure)."""

from __future__ import annotations

import os
import random
from types import ModuleType
from typing import Any

import pytest

SEED_ENV = "COSYEDGE_HYPOTHESIS_SEED"
_seed: int | None = None


def configure(config: pytest.Config) -> int:
    """Load the profile and force the run's seed; returns the seed."""
    from hypothesis import HealthCheck, core, settings

    global _seed
    settings.register_profile("cosyedge", derandomize=False, database=None, deadline=None, print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("cosyedge")
    given = config.getoption("--hypothesis-seed", None) or os.environ.get(SEED_ENV, "").strip()
    _seed = int(given) if given else random.SystemRandom().randrange(2**32)
    core.global_force_seed = _seed
    return _seed


def header() -> str:
    return f"hypothesis seed: {_seed} (replay: {SEED_ENV}={_seed})"


def uses_hypothesis(module: ModuleType | None) -> bool:
    return module is not None and any(
        getattr(v, "__module__", "").startswith("hypothesis") for v in vars(module).values()
    )


def add_seed_to_failure(item: pytest.Item, report: Any) -> None:
    if report.failed and uses_hypothesis(getattr(item, "module", None)):
        report.sections.append(("hypothesis seed", header()))
