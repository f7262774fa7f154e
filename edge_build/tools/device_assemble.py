"""One device run's raw JSON for docs/benchmarks/, from what the device tool brought back of
`device_plan.sh wait` calls (each call's folder: results.tgz with every step's JSON, the newest
JSON files beside it, logs.tgz with the plan and its status), and the figures the goals read:

    python -m cosyedge_build.tools.device_assemble DIR [DIR ...] --run "thirtieth device run (issue 23)"
        --device "NVIDIA H100 80GB HBM3 (...)" --script "device_plan.sh at <commit> with STEPS=..."
        [--note TEXT ...] [--keep-trace bench ...] [--out docs/benchmarks/h100-DATE-runN.json]

Later folders win where two hold the same step's file. Entries are named by their file:
bench_h200[_TAG].json -> bench[_TAG], bench_h200_batch_TAG.json -> batch_TAG, cloud_h200[_TAG].json
-> cloud[_TAG] (with the plan's CLOUD_PARAMS as `params`). The graph threads' traces are large: only
the entries named by --keep-trace keep theirs. Prints the summary either way."""

from __future__ import annotations

import argparse
import io
import json
import re
import tarfile
from datetime import date
from pathlib import Path
from typing import Any

_NAMES = ((re.compile(r"bench_h200_batch_(.+)\.json$"), "batch_{}"),
          (re.compile(r"bench_h200_(.+)\.json$"), "bench_{}"), (re.compile(r"bench_h200\.json$"), "bench"),
          (re.compile(r"cloud_h200_(.+)\.json$"), "cloud_{}"), (re.compile(r"cloud_h200\.json$"), "cloud"))
GB = 1e9


def entry_name(path: str) -> str | None:
    """The raw JSON's entry for a step's file (its folder is the plan's entry letter), or None."""
    name = path.rsplit("/", 1)[-1]
    for pattern, form in _NAMES:
        if (m := pattern.search(name)) is not None:
            return form.format(*m.groups())
    return None


def collect(dirs: list[Path]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """(the steps' reports by entry, the logs' text files by name) over the folders in order."""
    reports: dict[str, dict[str, Any]] = {}
    texts: dict[str, str] = {}
    for d in dirs:
        results = d / "results.tgz"
        if results.exists():
            with tarfile.open(results) as tar:
                for member in tar.getmembers():
                    name = entry_name(member.name)
                    f = tar.extractfile(member) if member.isfile() else None
                    if name is not None and f is not None:
                        reports[name] = json.loads(f.read())
        for loose in sorted(d.glob("*.json")):
            if (name := entry_name(loose.name)) is not None:
                reports[name] = json.loads(loose.read_text())
        logs = d / "logs.tgz"
        if logs.exists():
            with tarfile.open(logs) as tar:
                for member in tar.getmembers():
                    base = member.name.rsplit("/", 1)[-1]
                    f = tar.extractfile(member) if member.isfile() and base in ("plan", "status") else None
                    if f is not None:
                        texts[base] = io.TextIOWrapper(f, encoding="utf-8").read()
    return reports, texts


def _cloud_params(plan: str, tag: str | None) -> str | None:
    for entry in plan.split(";"):
        words = entry.split()
        if len(words) >= 2 and words[1] == "cloud":
            kv = dict(w.split("=", 1) for w in words[2:] if "=" in w)
            if kv.get("JSON_TAG") == tag:
                return kv.get("CLOUD_PARAMS", "").replace("+", " ") or None
    return None


def assemble(reports: dict[str, dict[str, Any]], texts: dict[str, str], run: str, device: str, script: str,
             notes: list[str], keep_trace: set[str]) -> dict[str, Any]:
    plan = texts.get("plan", "").strip()
    doc: dict[str, Any] = {"device": device, "date": date.today().isoformat(), "run": run, "script": script,
                           "plan": plan, "status": texts.get("status", "").strip().splitlines(), "notes": notes,
                           "graph_device_used_gb": {}}
    for name in sorted(reports, key=lambda n: (not n.startswith("bench"), n)):
        report = dict(reports[name])
        if name.startswith("cloud"):
            report = {"params": _cloud_params(plan, name[len("cloud_"):] if name != "cloud" else None), **report}
        used = report.get("graph_device_used_bytes")
        if used:
            doc["graph_device_used_gb"][name] = {k: round(v / GB, 2) for k, v in used.items()}
        if name not in keep_trace:
            for key in ("concurrency", "concurrency_offline"):
                levels = report.get(key)
                if isinstance(levels, dict):
                    report[key] = {lv: {k: v for k, v in entry.items() if k != "graph_trace"}
                                   for lv, entry in levels.items()}
        doc[name] = report
    return doc


def summary(doc: dict[str, Any]) -> list[str]:
    """A line per level of each entry: what the goals read (first audio, the slowest stream, requests/s
    against one stream's, offline RTF, the LLM's hand-overs), and the official pipeline where it ran."""
    lines = []
    for name, report in doc.items():
        if not isinstance(report, dict):
            continue
        ref = report.get("reference")
        if isinstance(ref, dict) and ref.get("first_audio_ms") is not None:
            lines.append(f"{name}: official {ref['first_audio_ms']} ms RTF {ref.get('rtf')}; engine "
                         f"{report.get('first_audio_ms')} ms RTF {report.get('rtf')}")
        levels = report.get("concurrency")
        if isinstance(levels, dict):
            one = levels.get("1", {}).get("requests_per_s")
            offline = report.get("concurrency_offline") or {}
            for lv, e in levels.items():
                ratio = f" ({e['requests_per_s'] / one:.2f}x)" if one and e.get("requests_per_s") else ""
                off = offline.get(lv, {}).get("rtf")
                lines.append(f"{name} c={lv}: {e.get('requests_per_s')} rps{ratio}, first audio p50 "
                             f"{e.get('first_audio_ms_p50')} p95 {e.get('first_audio_ms_p95')} ms, stream_rtf_max "
                             f"{e.get('stream_rtf_max')}, failed {e.get('failed')}"
                             + (f", offline RTF {off}" if off is not None else "")
                             + (f", handovers {e['llm_handovers']} for {e['llm_handed_tokens']} tokens"
                                if "llm_handovers" in e else ""))
        for lv in report.get("levels", []) if name.startswith("cloud") else []:
            lines.append(f"{name} c={lv.get('concurrency')}: {lv.get('throughput_rps')} rps, first chunk p50 "
                         f"{lv.get('first_chunk_ms', {}).get('p50')} ms, errors {lv.get('errors')}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", type=Path, nargs="+", help="the device calls' folders, oldest first")
    p.add_argument("--run", required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--script", required=True)
    p.add_argument("--note", action="append", default=[])
    p.add_argument("--keep-trace", action="append", default=[], help="an entry whose graph traces stay")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    reports, texts = collect(args.dirs)
    if not reports:
        p.error(f"no step results in {', '.join(map(str, args.dirs))}")
    doc = assemble(reports, texts, args.run, args.device, args.script, args.note, set(args.keep_trace))
    if args.out is not None:
        args.out.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    print("\n".join(summary(doc)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
