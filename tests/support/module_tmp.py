"""Folders for a test module's shared (module-scoped) fixtures that go when the module's tests end:
kept until the session's end, the suite's exported bundles, quantized variants and emulated engines
held gigabytes of a CI machine's disk at once (docs/testing.md)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


class ModuleTmp:
    """`mktemp` as pytest's TempPathFactory's; `remove` takes back every folder it made."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self._factory = factory
        self._made: list[Path] = []

    def mktemp(self, name: str) -> Path:
        path = self._factory.mktemp(name)
        self._made.append(path)
        return path

    def remove(self) -> None:
        for path in self._made:
            shutil.rmtree(path, ignore_errors=True)
        self._made.clear()
