"""A backend wrapper for deterministic stage timing in tests: every session
sleeps a fixed time per call before running (so one stage dominates by
construction, not by machine speed), counts its calls, and can fail after a
number of calls."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from cosyedge_models.backends.base import Backend, DecodeLoop, HostDecodeLoop, Session
from cosyedge_models.backends.flow_cache import HostStepCache, StepCache, StepCacheSpec
from cosyedge_models.errors import SynthesisError


@dataclass
class StagePlan:
    delay_s: dict[str, float] = field(default_factory=dict)  # stage -> sleep per run
    fail_after: dict[str, int] = field(default_factory=dict)  # stage -> calls that succeed, then SynthesisError
    calls: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, stage: str) -> int:
        with self.lock:
            n = self.calls.get(stage, 0) + 1
            self.calls[stage] = n
            return n


class SlowSession:
    def __init__(self, inner: Session, plan: StagePlan) -> None:
        self._inner = inner
        self._plan = plan
        self.name = inner.name
        self.input_names = inner.input_names
        self.output_names = inner.output_names

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        n = self._plan.count(self.name)
        limit = self._plan.fail_after.get(self.name)
        if limit is not None and n > limit:
            raise SynthesisError(f"{self.name}: injected failure at call {n}")
        time.sleep(self._plan.delay_s.get(self.name, 0.0))
        return self._inner.run(inputs, outputs)

    def memory_bytes(self) -> int:
        return self._inner.memory_bytes()

    def close(self) -> None:
        self._inner.close()


class SlowBackend:
    """Wraps a host backend; the decode loop goes through the wrapped sessions."""

    def __init__(self, inner: Backend, plan: StagePlan) -> None:
        self._inner = inner
        self.plan = plan
        self.name = inner.name

    def load(self, stage: str, path: Path, *, threads: int | None = None) -> Session:
        return SlowSession(self._inner.load(stage, path, threads=threads), self.plan)

    def decode_loop(self, prefill: Session, decode: Session) -> DecodeLoop:
        return HostDecodeLoop(prefill, decode)

    def flow_cache(self, estimator: Session, spec: StepCacheSpec) -> StepCache:
        return HostStepCache(estimator, spec)

    def describe(self) -> dict[str, str]:
        return self._inner.describe()
