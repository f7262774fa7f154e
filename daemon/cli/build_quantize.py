"""`cosyedge build quantize --bundle B --out B8`: the CLI wiring for
cosyedge_build.quantize.

daemon/cli/build.py calls `add_quantize_arguments(parser)` on its `quantize`
subparser and `quantize_command(args)` when it is chosen."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cosyedge_build.quantize.settings import QuantizeSettings


def add_quantize_arguments(p: argparse.ArgumentParser) -> None:
    """The options beyond --bundle (safe to call on a parser that has --bundle)."""
    from cosyedge_build.quantize.settings import PRECISIONS, AccuracyBudget, QuantizeSettings  # the build extra

    if not any("--bundle" in a.option_strings for a in p._actions):
        p.add_argument("--bundle", required=True, help="fp32 bundle directory (read only)")
    d = AccuracyBudget()
    p.add_argument("--out", required=True, help="new bundle directory to write (must not exist)")
    p.add_argument("--precision", choices=PRECISIONS, default="int8")
    p.add_argument("--calibration-size", type=int, default=QuantizeSettings.calibration_size,
                   help="calibration texts to synthesize")
    p.add_argument("--held-out-size", type=int, default=QuantizeSettings.held_out_size,
                   help="held-out texts for the accuracy report")
    p.add_argument("--feeds-per-stage", type=int, default=QuantizeSettings.feeds_per_stage,
                   help="recorded inputs kept per stage graph")
    p.add_argument("--calibration-method", choices=["minmax", "percentile"], default="minmax")
    p.add_argument("--min-llm-cosine", type=float, default=d.llm_cosine_min)
    p.add_argument("--min-llm-top1", type=float, default=d.llm_top1_min)
    p.add_argument("--min-mel-snr-db", type=float, default=d.mel_snr_min_db)
    p.add_argument("--min-wav-snr-db", type=float, default=d.wav_snr_min_db)
    p.add_argument("--min-e2e-match", type=float, default=d.e2e_match_min,
                   help="mean fraction of speech tokens equal to fp32's before the first difference")
    p.add_argument("--force", action="store_true", help="write the bundle even if it misses the budget")
    p.add_argument("--max-memory-gb", type=float, default=None,
                   help="refuse to start when the estimated peak memory exceeds this (free memory is always checked)")


def settings_from_args(args: argparse.Namespace) -> QuantizeSettings:
    """Options left out or None take the defaults (the `cosyedge` parser leaves them None)."""
    from cosyedge_build.quantize.settings import AccuracyBudget, QuantizeSettings

    d, q = AccuracyBudget(), QuantizeSettings()

    def opt(name: str, default: Any) -> Any:
        value = getattr(args, name, None)
        return default if value is None else value

    budget = AccuracyBudget(llm_cosine_min=opt("min_llm_cosine", d.llm_cosine_min),
                            llm_top1_min=opt("min_llm_top1", d.llm_top1_min),
                            mel_snr_min_db=opt("min_mel_snr_db", d.mel_snr_min_db),
                            wav_snr_min_db=opt("min_wav_snr_db", d.wav_snr_min_db),
                            e2e_match_min=opt("min_e2e_match", d.e2e_match_min))
    return QuantizeSettings(precision=opt("precision", q.precision),
                            calibration_size=opt("calibration_size", q.calibration_size),
                            held_out_size=opt("held_out_size", q.held_out_size),
                            feeds_per_stage=opt("feeds_per_stage", q.feeds_per_stage),
                            calibration_method=opt("calibration_method", q.calibration_method),
                            force=bool(getattr(args, "force", False)), budget=budget,
                            max_memory_gb=opt("max_memory_gb", None))


def format_report(report: dict[str, Any]) -> str:
    lines = [f"{report['precision']} vs fp32 on {len(report['held_out_texts'])} held-out texts:"]
    m, b = report["metrics"], report["budget"]
    rows = [("llm logits cosine", m["llm_cosine"], b["llm_cosine_min"]),
            ("llm top-1 agreement", m["llm_top1"], b["llm_top1_min"]),
            ("flow mel SNR dB", m["mel_snr_db"], b["mel_snr_min_db"]),
            ("vocoder waveform SNR dB", m["wav_snr_db"], b["wav_snr_min_db"]),
            ("e2e matched token fraction", m["e2e_match"], b["e2e_match_min"])]
    lines.append(f"  {'metric':28} {'value':>10} {'budget':>10}")
    for name, value, floor in rows:
        lines.append(f"  {name:28} {value:10.4f} {floor:10.4f} {'ok' if value >= floor else 'FAIL'}")
    for unit in report["units"]:
        for row in unit.get("sensitivity", []):
            vals = ", ".join(f"{k} {float(v):.4f}" for k, v in row.items() if k not in ("group", "nodes"))
            lines.append(f"  sensitivity {unit['unit']:8} {row['group']:15} ({row['nodes']} nodes alone): {vals}")
        if "excluded_groups" in unit:
            lines.append(f"  {unit['unit']}: kept in fp32: {', '.join(unit['excluded_groups']) or 'nothing'}")
    for stage, s in report["sizes"].items():
        lines.append(f"  {stage:16} {s['fp32_bytes'] / 1e6:9.2f} MB -> {s['variant_bytes'] / 1e6:9.2f} MB")
    mem = report.get("memory")
    if mem:
        lines.append(f"  peak RSS {mem['peak_rss_bytes'] / (1 << 30):.2f} GiB "
                     f"(estimated before the run: {mem['estimate']['peak_bytes'] / (1 << 30):.2f} GiB, "
                     f"{mem['estimate']['peak_phase']})")
    return "\n".join(lines)


def quantize_command(args: argparse.Namespace) -> int:
    from cosyedge_build.quantize.pipeline import QuantizeBudgetError, quantize_bundle

    settings = settings_from_args(args)
    try:
        report = quantize_bundle(Path(args.bundle), Path(args.out), settings)
    except QuantizeBudgetError as exc:
        print(format_report(exc.report))
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    if report["failed"]:
        print("warning: written with --force although it misses the budget: " + "; ".join(report["failed"]),
              file=sys.stderr)
    print(f"wrote {args.out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(prog="cosyedge build quantize")
    add_quantize_arguments(p)
    return quantize_command(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
