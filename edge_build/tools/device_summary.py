"""The short table a device call's output ends with, from a `cosyedge bench
--json` file: python -m cosyedge_build.tools.device_summary BENCH.json"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

KEYS = ("machine", "precision", "rtf", "streaming_rtf", "first_audio_ms", "stages_ms", "static_flow",
        "streaming_cost_vs_offline", "speedup_vs_reference", "first_audio_vs_reference", "peak_rss_mb", "voice_cache")


def summary(report: dict[str, Any]) -> dict[str, Any]:
    out = {k: report.get(k) for k in KEYS if k in report}
    out["reference"] = {k: report.get("reference", {}).get(k) for k in ("rtf", "first_audio_ms")}
    out["concurrency"] = report.get("concurrency")
    out["compare"] = [{k: c.get(k) for k in ("precision", "rtf", "streaming_rtf", "first_audio_ms", "accuracy")}
                      for c in report.get("compare", [])]
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    print(json.dumps(summary(json.loads(Path(args[0]).read_text())), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
