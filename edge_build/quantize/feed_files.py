"""Recorded stage feeds kept on disk: one .npy file per array, read back one
feed at a time, so that calibration data never sits in memory all at once
(at full size one streaming estimator feed carries seconds of K/V cache and
32 of them per stage outgrow a build host)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import overload

import numpy as np

Feed = dict[str, np.ndarray]


class DiskFeeds(Sequence[Feed]):
    """The feeds of one stage, slot i in `root/<i>/<input>.npy`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._slots: list[Path] = []

    def _slot_dir(self, index: int) -> Path:
        return self.root / f"{index:05d}"

    def put(self, index: int, feed: Mapping[str, np.ndarray]) -> None:
        """Write slot `index` (append when index == len(self), else replace)."""
        if not 0 <= index <= len(self._slots):
            raise IndexError(f"slot {index} out of range 0..{len(self._slots)}")
        slot = self._slot_dir(index)
        shutil.rmtree(slot, ignore_errors=True)
        slot.mkdir()
        for name, value in feed.items():
            # input names are graph input names (identifiers); the .npy keeps dtype and shape
            np.save(slot / f"{name}.npy", np.ascontiguousarray(value), allow_pickle=False)
        if index == len(self._slots):
            self._slots.append(slot)

    def _load(self, index: int) -> Feed:
        slot = self._slots[index]
        return {p.stem: np.load(p, allow_pickle=False) for p in sorted(slot.glob("*.npy"))}

    def __len__(self) -> int:
        return len(self._slots)

    @overload
    def __getitem__(self, index: int) -> Feed: ...

    @overload
    def __getitem__(self, index: slice) -> list[Feed]: ...

    def __getitem__(self, index: int | slice) -> Feed | list[Feed]:
        if isinstance(index, slice):
            return [self._load(i) for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self._load(index)

    def __iter__(self) -> Iterator[Feed]:
        for i in range(len(self)):
            yield self._load(i)

    def nbytes(self) -> int:
        return sum(p.stat().st_size for slot in self._slots for p in slot.glob("*.npy"))
