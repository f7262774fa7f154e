"""Which model version serves a request: the request's pin, else a canary
share of the traffic to the new version, else the default. Pure logic, so
the split can be checked statistically with a seeded generator."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

from cosyedge_cloud.wire.protocol import ProtocolError


@dataclass(frozen=True)
class VersionChoice:
    version: str  # "" lets Triton pick its highest loaded version
    reason: str  # "pinned", "canary" or "default"


class VersionSelector:
    def __init__(
        self,
        default_version: str = "",
        canary_version: str = "",
        canary_share: float = 0.0,
        allowed_versions: tuple[str, ...] = (),
        seed: int | None = None,
    ) -> None:
        if not 0.0 <= canary_share <= 1.0:
            raise ValueError(f"canary_share must be in [0, 1], got {canary_share}")
        self.default_version = default_version
        self.canary_version = canary_version
        self.canary_share = canary_share if canary_version else 0.0
        self.allowed_versions = allowed_versions
        self._rng = random.Random(seed)
        self._lock = threading.Lock()  # workers choose concurrently; Random is not meant to be shared

    def choose(self, pinned: str | None, request_id: str | None = None) -> VersionChoice:
        if pinned is not None:
            if self.allowed_versions and pinned not in self.allowed_versions:
                raise ProtocolError(
                    "unknown_version",
                    f"model version {pinned} may not be pinned here; allowed: {', '.join(self.allowed_versions)}",
                    request_id,
                )
            return VersionChoice(pinned, "pinned")
        if self.canary_share > 0.0:
            with self._lock:
                draw = self._rng.random()
            if draw < self.canary_share:
                return VersionChoice(self.canary_version, "canary")
        return VersionChoice(self.default_version, "default")
