"""No test may skip quietly on a component that CI installs: such a test
calls tests/support/components.py (require_binary, require_module,
require_data: skip locally, fail under CI=true). A plain skip is left only
for what CI does not have by design: a GPU, the CUDA provider, a real
TensorRT or torchaudio."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
RULE = TESTS / "support" / "components.py"
HARDWARE = re.compile(r"GPU|CUDA|real TensorRT|real torchaudio")
SKIP = re.compile(r"pytest\.(?:skip\(|mark\.skip\()")


def _sources() -> list[Path]:
    return [p for p in sorted(TESTS.rglob("*.py")) if p not in (RULE, Path(__file__).resolve())]


def test_no_importorskip_or_skipif() -> None:
    found = [f"{p.relative_to(TESTS)}:{n}" for p in _sources()
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if "importorskip" in line or "mark.skipif" in line]
    assert found == [], f"use tests.support.components.require_module / missing instead: {found}"


def test_plain_skips_are_only_for_hardware() -> None:
    found = []
    for p in _sources():
        lines = p.read_text().splitlines()
        for n, line in enumerate(lines):
            if SKIP.search(line) and not HARDWARE.search(" ".join(lines[n:n + 2])):
                found.append(f"{p.relative_to(TESTS)}:{n + 1}: {line.strip()}")
    assert found == [], f"a skip on a component CI installs must use tests.support.components: {found}"
