"""Memory of a daemon process, for the fuzz and soak suites."""

from __future__ import annotations


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def sample_due(done: int, total: int, warmup: float = 0.1) -> bool:
    """Whether to sample RSS after `done` of `total` examples: once at the end of the
    warm-up (the first tenth; a CI-sized run takes a larger share), then every twentieth."""
    first = max(1, int(total * warmup))
    return done == first or (done > first and done % max(1, total // 20) == 0)


def growth_after_warmup(samples: list[int]) -> float:
    """RSS growth from the first sample (taken after the warm-up) to the last."""
    return round((samples[-1] - samples[0]) / samples[0], 4)


def steady_growth(samples: list[int]) -> float:
    """Growth after the warm-up less its largest single step between two samples.

    A leak keeps growing from sample to sample; a one-off allocation (an allocator arena
    for a new thread, a cache reaching its bound) is one step. A CI run of the Wyoming fuzz
    grew 5.6 % in all, 2.8 MiB of it between two samples and flat afterwards (stop 33)."""
    steps = [b - a for a, b in zip(samples[:-1], samples[1:], strict=True)]
    largest = max([0, *steps])
    return round((samples[-1] - samples[0] - largest) / samples[0], 4)
