"""The bundle `cosyedge run` uses without --bundle: the tiny randomly
initialised CosyVoice 2 bundle in the user's cache directory, built on
first use with the build side (needs the `build` extra)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from cosyedge_models.errors import MissingExtraError

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """systemd's CacheDirectory= ($CACHE_DIRECTORY), else $XDG_CACHE_HOME/cosyedge or ~/.cache/cosyedge."""
    if os.environ.get("CACHE_DIRECTORY"):
        return Path(os.environ["CACHE_DIRECTORY"].split(":")[0])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cosyedge"


def tiny_bundle_dir() -> Path:
    return cache_dir() / "tiny-bundle"


def _current(path: Path) -> bool:
    """A built tiny bundle of the format this cosyedge reads. One left by an
    older version (another format) is rebuilt: it is only our own cache."""
    from cosyedge_models.bundle.loader import FORMAT_VERSION

    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("format_version") == FORMAT_VERSION:
        return True
    log.info("the tiny bundle in %s has format %r, not %d: rebuilding it", path, manifest.get("format_version"),
             FORMAT_VERSION)
    return False


def ensure_tiny_bundle(path: Path | None = None) -> Path:
    """The tiny bundle, built (once, atomically) if it is not there yet."""
    path = path or tiny_bundle_dir()
    if _current(path):
        return path
    try:
        from cosyedge_build.checkpoint.tiny import build_tiny_checkpoint
        from cosyedge_build.export import export_bundle
    except ImportError as exc:
        if getattr(exc, "name", "") and str(exc.name).split(".")[0] == "cosyedge_build":
            raise
        raise MissingExtraError(
            str(getattr(exc, "name", "torch")), "build", "building the tiny test bundle (no --bundle given)"
        ) from exc
    log.info("building the tiny bundle in %s (first run only)", path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".tiny-build-", dir=path.parent) as tmp:
        model_dir, bundle = Path(tmp) / "checkpoint", Path(tmp) / "bundle"
        build_tiny_checkpoint(model_dir, seed=0, size="tiny")
        export_bundle(model_dir, bundle)
        if path.exists():
            shutil.rmtree(path)
        bundle.rename(path)
    return path
