"""`model pull --set-default`: set keys of one section of a TOML config file,
keeping the rest of the file (comments included) as it is. The result is
loaded with the settings schema before it replaces the file."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from cosyedge_daemon.settings.loader import load_settings


def set_keys(text: str, section: str, values: dict[str, str]) -> str:
    """`text` with `key = "value"` for each of `values` in `[section]`:
    an existing line replaced, else added under the header (or a new section)."""
    lines = text.splitlines()
    header = re.compile(rf"^\s*\[\s*{re.escape(section)}\s*\]\s*(#.*)?$")
    start = next((i for i, line in enumerate(lines) if header.match(line)), None)
    rendered = {k: f"{k} = {json.dumps(v)}" for k, v in values.items()}  # a JSON string is a TOML basic string
    if start is None:
        return text.rstrip("\n") + ("\n\n" if text.strip() else "") + "\n".join([f"[{section}]",
                                                                                 *rendered.values()]) + "\n"
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"^\s*\[", lines[i])), len(lines))
    todo = dict(rendered)
    for i in range(start + 1, end):
        m = re.match(r"^\s*([A-Za-z0-9_-]+)\s*=", lines[i])
        if m and m.group(1) in todo:
            lines[i] = todo.pop(m.group(1))
    lines[start + 1:start + 1] = list(todo.values())
    return "\n".join(lines) + "\n"


def write_config(path: Path, section: str, values: dict[str, str]) -> None:
    """Edit `path` (created when missing); refused, unchanged, when the result does not load."""
    old = path.read_text() if path.exists() else ""
    new = set_keys(old, section, values)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(new)
        load_settings(tmp)  # raises with the schema's message
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
