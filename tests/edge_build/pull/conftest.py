"""The fake hub serving the tiny checkpoint (tests/support/fake_hub.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fake_hub import TINY_EXTRA, TINY_REPO, FakeHub, tiny_hub

REPO, EXTRA = TINY_REPO, TINY_EXTRA


@pytest.fixture
def fake_hub(tiny_model_dir: Path) -> Iterator[FakeHub]:
    with tiny_hub(tiny_model_dir) as hub:
        yield hub
