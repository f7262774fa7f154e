"""What `model pull` downloads, and how a downloaded file is checked: pure
logic over a repository's file list (no network here).

The export reads the files of reference/modules.REQUIRED_FILES, the voices
(spk2info.pt, optional) and the Qwen2 folder CosyVoice-BlankEN (its config,
tokenizer and weights: upstream builds the LLM from it before llm.pt is
loaded). Everything else of the repository (the upstream runtime's own
TensorRT/ONNX exports, zips, samples) is skipped."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosyedge_build.reference.modules import QWEN_DIR, REQUIRED_FILES
from cosyedge_models.errors import CosyEdgeError

OPTIONAL_FILES = ("spk2info.pt",)
SOURCES = ("huggingface", "modelscope")


@dataclass(frozen=True)
class KnownModel:
    name: str
    repos: dict[str, str]  # source -> repository id


KNOWN_MODELS = {
    "cosyvoice2-0.5b": KnownModel("CosyVoice2-0.5B", {"huggingface": "FunAudioLLM/CosyVoice2-0.5B",
                                                      "modelscope": "iic/CosyVoice2-0.5B"}),
}
DEFAULT_MODEL = "CosyVoice2-0.5B"


def resolve_repo(name: str, source: str) -> tuple[str, str]:
    """(repository id, model name) for a known model name or an `owner/repo` id."""
    if source not in SOURCES:
        raise CosyEdgeError(f"unknown source '{source}'; allowed: {', '.join(SOURCES)}")
    known = KNOWN_MODELS.get(name.lower())
    if known is not None:
        return known.repos[source], known.name
    if name.count("/") == 1 and all(name.split("/")):
        return name, name.split("/")[1]
    raise CosyEdgeError(f"unknown model '{name}': give one of {', '.join(m.name for m in KNOWN_MODELS.values())} "
                        f"or a repository id (owner/name) in the CosyVoice 2 layout")


class ChecksumError(CosyEdgeError):
    """A downloaded file does not match the hub's size or hash."""


@dataclass(frozen=True)
class RepoFile:
    path: str
    size: int | None
    sha256: str | None = None  # LFS files: the content's sha256
    blob_id: str | None = None  # other files: git's blob id (sha1 of "blob <size>\0" + content)

    @property
    def checkable(self) -> bool:
        return self.sha256 is not None or self.blob_id is not None


def needed_files(files: Iterable[RepoFile], repo: str) -> list[RepoFile]:
    """The files the export reads, in the repository's order; a repository
    without one of the required ones is refused before anything downloads."""
    files = list(files)
    names = {f.path for f in files}
    missing = [f for f in REQUIRED_FILES if f not in names]
    if missing:
        raise CosyEdgeError(f"{repo} is not a CosyVoice 2 checkpoint: it has no {', '.join(missing)} "
                            f"(expected the layout of FunAudioLLM/CosyVoice2-0.5B)")
    wanted = set(REQUIRED_FILES) | set(OPTIONAL_FILES)
    return [f for f in files if f.path in wanted or f.path.startswith(f"{QWEN_DIR}/")]


def git_blob_id(path: Path) -> str:
    h = hashlib.sha1(usedforsecurity=False)
    h.update(f"blob {path.stat().st_size}\0".encode())
    _feed(h, path)
    return h.hexdigest()


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    _feed(h, path)
    return h.hexdigest()


def _feed(h: Any, path: Path) -> None:
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)


def verify(path: Path, expected: RepoFile, source: str) -> str:
    """Size, then the hash the hub published; returns the hash checked.
    Raises ChecksumError naming the file and both values."""
    size = path.stat().st_size
    if expected.size is not None and size != expected.size:
        raise ChecksumError(f"{expected.path}: {size} bytes downloaded, {source} says {expected.size}")
    if expected.sha256 is not None:
        got, want, kind = sha256_of(path), expected.sha256.lower(), "sha256"
    elif expected.blob_id is not None:
        got, want, kind = git_blob_id(path), expected.blob_id.lower(), "git blob id"
    else:
        return ""
    if got != want:
        raise ChecksumError(f"{expected.path}: {kind} {got} does not match {source}'s {want}: the download is "
                            "corrupt (or the mirror serves another file); it was deleted, run the pull again")
    return got
