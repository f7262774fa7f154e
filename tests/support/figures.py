"""Raw results of the reliability suites: with COSYEDGE_RELIABILITY_OUT set
(a folder, e.g. docs/reliability), each suite writes its figures there as
<suite>-<machine>-<date>.json; docs/reliability.md quotes them."""

from __future__ import annotations

import datetime
import json
import os
import re
from pathlib import Path
from typing import Any

from cosyedge_models.tools.host import machine


def record(suite: str, figures: dict[str, Any]) -> Path | None:
    out = os.environ.get("COSYEDGE_RELIABILITY_OUT")
    if not out:
        return None
    m = machine()
    day = datetime.date.today().isoformat()
    slug = re.sub(r"[^a-z0-9]+", "-", m.lower()).strip("-")[:40]
    path = Path(out) / f"{suite}-{slug}-{day}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"suite": suite, "machine": m, "date": day, **figures}, indent=2) + "\n")
    return path
