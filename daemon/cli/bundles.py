"""The bundles folder: where `cosyedge model pull` installs bundles, what
`model list`, `model remove` and `doctor` read. One folder per bundle, named
`<model>-<precision>` (lower case), each with its manifest.json and, when it
was pulled, `pull.json` (source, repository, commit).

A bundle is replaced by two renames (old aside, new in place): a run stopped
between them leaves `.<name>.replaced`, which `recover` puts back, so an
installed bundle is never half-written and never lost before its successor
is complete."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosyedge_models.errors import CosyEdgeError

log = logging.getLogger(__name__)

PULL_RECORD = "pull.json"
_REPLACED = ".replaced"
_REMOVING = ".removing-"
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,99}$")


SYSTEM_BUNDLES = Path("/var/lib/cosyedge/bundles")  # systemd/cosyedge.tmpfiles creates it


def bundles_dir(configured: str = "", system: Path = SYSTEM_BUNDLES) -> Path:
    """`[tts] bundles_dir`; else systemd's StateDirectory= + /bundles; else the
    service's folder when this user may write it (root, or the service's user
    outside the unit: `sudo -u cosyedge cosyedge model pull`); else
    $XDG_DATA_HOME/cosyedge/bundles (~/.local/share/cosyedge/bundles)."""
    if configured:
        return Path(configured).expanduser()
    if os.environ.get("STATE_DIRECTORY"):
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0]) / "bundles"
    if system.is_dir() and os.access(system, os.W_OK | os.X_OK):
        return system
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "cosyedge" / "bundles"


def bundle_name(model: str, precision: str) -> str:
    """`CosyVoice2-0.5B`, `int8` -> `cosyvoice2-0.5b-int8` (a repository id keeps its last part)."""
    name = f"{model.rstrip('/').rpartition('/')[2]}-{precision}".lower()
    name = re.sub(r"[^a-z0-9._-]+", "-", name).strip("-.")
    check_name(name)
    return name


def check_name(name: str) -> None:
    if not _NAME.match(name):
        raise CosyEdgeError(f"'{name}' is not a bundle name: lower-case letters, digits, '.', '_' and '-', "
                            "starting with a letter or digit (`cosyedge model list` shows the installed ones)")


@dataclass(frozen=True)
class InstalledBundle:
    name: str
    path: Path
    precision: str
    size_bytes: int
    engines: bool
    source: dict[str, Any]
    problem: str = ""  # non-empty: the folder is not a readable bundle

    def line(self) -> str:
        if self.problem:
            return f"{self.name}: {self.problem} ({self.path})"
        origin = ""
        if self.source:
            commit = str(self.source.get("commit", ""))[:12]
            origin = f", from {self.source.get('source', '?')} {self.source.get('repo', '?')}@{commit}"
        engines = ", TensorRT engines" if self.engines else ""
        return f"{self.name}: {self.precision}, {self.size_bytes / 1e6:.0f} MB{engines}{origin} ({self.path})"


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def read_bundle(path: Path) -> InstalledBundle:
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        return InstalledBundle(path.name, path, "?", 0, False, {}, f"no readable manifest.json: {exc}")
    try:
        source = json.loads((path / PULL_RECORD).read_text())
    except (OSError, ValueError):
        source = {}
    return InstalledBundle(path.name, path, str(manifest.get("precision", "fp32")), _size(path),
                           bool(manifest.get("engines")), source if isinstance(source, dict) else {})


def recover(root: Path) -> None:
    """Finish what an interrupted install or remove left: a bundle set aside
    whose successor never arrived goes back; leftovers are deleted."""
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if entry.name.startswith(".") and entry.name.endswith(_REPLACED):
            name = entry.name[1:-len(_REPLACED)]
            if (root / name).exists():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                log.warning("putting back %s: the install that replaced it did not finish", name)
                entry.rename(root / name)
        elif entry.name.startswith(_REMOVING):
            shutil.rmtree(entry, ignore_errors=True)


def list_bundles(root: Path) -> list[InstalledBundle]:
    recover(root)
    if not root.is_dir():
        return []
    return [read_bundle(p) for p in sorted(root.iterdir()) if p.is_dir() and not p.name.startswith(".")]


def install_bundle(root: Path, name: str, built: Path, record: dict[str, Any]) -> Path:
    """Move the complete bundle `built` (on the same filesystem as `root`)
    into `root/name`, replacing one there only now."""
    check_name(name)
    (built / PULL_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    target, aside = root / name, root / f".{name}{_REPLACED}"
    recover(root)
    if target.exists():
        target.rename(aside)
    built.rename(target)
    shutil.rmtree(aside, ignore_errors=True)
    return target


def remove_bundle(root: Path, name: str) -> Path:
    """Delete an installed bundle: first renamed out of sight (the daemon's
    next load cannot find half of it), then deleted."""
    check_name(name)
    recover(root)
    target = root / name
    if not (target / "manifest.json").is_file() and not target.is_dir():
        known = ", ".join(b.name for b in list_bundles(root)) or "none"
        raise CosyEdgeError(f"no bundle '{name}' in {root} (installed: {known})")
    gone = Path(tempfile.mkdtemp(prefix=f"{_REMOVING}{name}-", dir=root))
    target.rename(gone / name)
    shutil.rmtree(gone)
    return target
