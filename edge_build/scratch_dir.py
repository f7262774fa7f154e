"""Build a directory atomically: write into a scratch folder beside it and
rename it into place, so a failed build leaves nothing half-written."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cosyedge_models.errors import CosyEdgeError


def check_new_dir(out: Path, what: str) -> None:
    """Refuse an `out` that exists and is not an empty directory."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CosyEdgeError(f"{out} exists and is not an empty directory (a file, or not empty); "
                           f"give a new {what} directory")


@contextmanager
def scratch_for(out: Path) -> Iterator[Path]:
    """Yield a scratch folder beside `out` (checked with check_new_dir); on a
    clean exit it becomes `out`, on an exception it is removed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    scratch.chmod(0o755)  # mkdtemp's 0700 would make the result private to the builder
    try:
        yield scratch
        if out.exists():
            out.rmdir()  # empty (checked by the caller)
        scratch.rename(out)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
