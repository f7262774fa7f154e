"""`cosyedge voice add|list`: manage the named voices of a bundle. A voice
added from a recording serves every mode (zero_shot needs its transcript)."""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

from cosyedge_models.bundle.loader import load_bundle
from cosyedge_models.errors import RequestError
from cosyedge_models.synthesis.api import PromptAudio, SynthesisRequest
from cosyedge_models.synthesis.conditioning import ConditioningBuilder
from cosyedge_models.synthesis.features import load_audio
from cosyedge_models.synthesis.prompt import PromptFeatures
from cosyedge_models.text.frontend import TextFrontend
from cosyedge_models.text.tokenizer import TextTokenizer

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def add_voice(bundle_dir: Path, name: str, wav: Path, transcript: str) -> Path:
    if not NAME.match(name):
        raise RequestError("bad_voice_name", f"voice name {name!r}: use letters, digits, '_', '.', '-' (max 64)")
    bundle = load_bundle(bundle_dir)
    tokenizer = TextTokenizer.from_file(bundle.file("tokenizer"))
    frontend = TextFrontend(tokenizer)
    pcm, sr = load_audio(wav)
    builder = ConditioningBuilder(bundle, tokenizer, frontend)
    try:
        feats = builder.prompt_features(SynthesisRequest(
            text="-", mode="zero_shot", prompt=PromptAudio(pcm=pcm, sample_rate=sr, text=transcript)))
    finally:
        builder.close()
    rel = f"voices/{name}.npz"
    feats.save(bundle.root / rel)
    manifest_path = bundle.root / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest.setdefault("voices", {})[name] = rel
    manifest.setdefault("default_voice", name)
    if manifest["default_voice"] is None:
        manifest["default_voice"] = name
    tmp = manifest_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, manifest_path)
    return bundle.root / rel


def voice_command(args: argparse.Namespace) -> int:
    if args.voice_cmd == "add":
        path = add_voice(Path(args.bundle), args.name, Path(args.wav), args.text)
        feats = PromptFeatures.load(path)
        print(f"added voice {args.name!r}: {feats.prompt_speech_token.size} prompt tokens, "
              f"{feats.prompt_text.size} transcript tokens -> {path}")
        return 0
    bundle = load_bundle(args.bundle)
    for name, path in sorted(bundle.voices.items()):
        feats = PromptFeatures.load(path)
        kind = "sft only" if not feats.has_prompt_speech else (
            "all modes" if feats.prompt_text.size else "sft, cross_lingual, instruct")
        default = " (default)" if name == bundle.default_voice else ""
        print(f"{name}{default}: {kind}")
    return 0
