"""The fake hub serving the tiny checkpoint (tests/support/fake_hub.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fake_hub import FakeHub, repo_from_dir

REPO = "tests/CosyVoice2-tiny"
# files of the real repository that the export does not read: never downloaded
EXTRA = {"README.md": b"# CosyVoice2\n", "flow.encoder.fp32.zip": b"PK" + b"\0" * 4000,
         "asset/zero_shot_prompt.wav": b"RIFF" + b"\0" * 2000}


@pytest.fixture
def fake_hub(tiny_model_dir: Path) -> Iterator[FakeHub]:
    with FakeHub([repo_from_dir(REPO, tiny_model_dir, EXTRA)]) as hub:
        yield hub
