"""No test may skip on its own: a test that needs a component calls
tests/support/components.py (require_binary, require_module, require_data for
what CI installs; not_here, require_cuda_provider for what CI lacks by design
or must not have: a GPU, the CUDA provider, a real TensorRT or torchaudio),
which skips locally and fails under CI=true, so a green CI run has run every
test it collected."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
RULE = TESTS / "support" / "components.py"
SKIP = re.compile(r"pytest\.(?:skip\(|mark\.skip\()")


def _sources() -> list[Path]:
    return [p for p in sorted(TESTS.rglob("*.py")) if p not in (RULE, Path(__file__).resolve())]


def test_no_importorskip_or_skipif() -> None:
    found = [f"{p.relative_to(TESTS)}:{n}" for p in _sources()
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if "importorskip" in line or "mark.skipif" in line]
    assert found == [], f"use tests.support.components.require_module / missing instead: {found}"


def test_no_plain_skips() -> None:
    found = [f"{p.relative_to(TESTS)}:{n}: {line.strip()}" for p in _sources()
             for n, line in enumerate(p.read_text().splitlines(), 1) if SKIP.search(line)]
    assert found == [], f"a skip goes through tests.support.components (missing, not_here): {found}"
