"""Small helpers for the cloud tests."""

from __future__ import annotations

import re
import time
import urllib.request

from cosyedge_cloud.triton.launcher import TritonServer


def triton_metric(server: TritonServer, name: str, **labels: str) -> float:
    """Sum of a Triton metric over the series matching the labels."""
    with urllib.request.urlopen(server.metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if not m:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def settled_metric(server: TritonServer, name: str, **labels: str) -> float:
    """triton_metric once it stops moving: Triton counts a decoupled request
    a moment after its last response (also an earlier test's), so read until
    two reads 0.3 s apart agree (at most ~15 s)."""
    last = triton_metric(server, name, **labels)
    for _ in range(50):
        time.sleep(0.3)
        now = triton_metric(server, name, **labels)
        if now == last:
            return now
        last = now
    return last
