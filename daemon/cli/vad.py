"""`cosyedge vad FILE.wav`: the daemon's own VAD segmentation on a recording,
one JSON line per utterance, for tuning the [vad] settings."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from cosyedge_daemon.audio.pcm import read_pcm16_16k
from cosyedge_daemon.audio.vad import segment_pcm
from cosyedge_daemon.settings.audio import AudioSettingsError, VadSettings
from cosyedge_models.settings_schema import read_toml


def _load_vad_table(path: str) -> dict[str, Any]:
    p = Path(path)
    data = read_toml(p)  # its ConfigError is an AudioSettingsError
    table = data.get("vad", {})
    if not isinstance(table, dict):
        raise AudioSettingsError(f"{p}: [vad] must be a table")
    return table


def vad_settings_from_args(args: argparse.Namespace) -> VadSettings:
    settings = VadSettings.from_mapping(_load_vad_table(args.config)) if args.config else VadSettings()
    overrides = {k: v for k, v in (("aggressiveness", args.aggressiveness), ("frame_ms", args.frame_ms))
                 if v is not None}
    return dataclasses.replace(settings, **overrides)


def vad_command(args: argparse.Namespace) -> int:
    settings = vad_settings_from_args(args)
    pcm = read_pcm16_16k(args.wav)
    for utt in segment_pcm(pcm, settings):
        line = {"start_ms": round(utt.start_s * 1000), "end_ms": round(utt.end_s * 1000),
                "duration_ms": round(utt.duration_ms)}
        if utt.forced_split:
            line["forced_split"] = True
        print(json.dumps(line), flush=True)
    print(f"{Path(args.wav).name}: {len(pcm) / 16000:.2f} s, aggressiveness {settings.aggressiveness}, "
          f"frame {settings.frame_ms} ms, hangover {settings.hangover_ms} ms", file=sys.stderr)
    return 0
