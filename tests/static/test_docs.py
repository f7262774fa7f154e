"""The user documentation stays whole: README.md is short and for users, and
every relative link in README.md and docs/ points at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_readme_is_for_users() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    # the two set-up commands the guide requires
    assert ".ci/setup && .venv/bin/cosyedge run" in text
    assert ".ci/setup && .venv/bin/python -m pytest" in text
    assert "noise" in text and "CosyVoice2-0.5B" in text


def test_relative_links_resolve() -> None:
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []
