"""`cosyedge synth`: offline synthesis with no daemon and no broker."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import cast

import numpy as np
import soundfile as sf
from cosyedge_models.synthesis.api import Mode, PromptAudio, SynthesisRequest
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import load_synthesizer


def synth_command(args: argparse.Namespace) -> int:
    prompt = None
    if args.prompt_wav:
        pcm, sr = sf.read(args.prompt_wav, dtype="float32", always_2d=True)
        prompt = PromptAudio(pcm=pcm.mean(axis=1), sample_rate=int(sr), text=args.prompt_text or "")
    mode = args.mode or ("zero_shot" if prompt is not None and args.prompt_text else
                         "cross_lingual" if prompt is not None else "sft")
    request = SynthesisRequest(text=args.text, mode=cast(Mode, mode), voice=args.voice,
                               instruct_text=args.instruct_text, prompt=prompt, stream=args.stream, seed=args.seed)
    t0 = time.perf_counter()
    engine = load_synthesizer(args.bundle, settings=SynthesisSettings(backend=args.backend))
    load_s = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        chunks = [c for c in engine.synthesize(request)]
        total_s = time.perf_counter() - t0
    finally:
        engine.close()
    audio = np.concatenate([c.pcm for c in chunks]) if chunks else np.zeros(0, np.float32)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sf.write(out, audio, engine.sample_rate, subtype="PCM_16")
    seconds = audio.size / engine.sample_rate
    times = chunks[-1].times if chunks else None
    first = f"{times.first_audio_ms:.0f} ms" if times and times.first_audio_ms is not None else "-"
    rtf = total_s / seconds if seconds else float("nan")
    print(f"wrote {out}: {seconds:.2f} s of audio in {len(chunks)} chunk(s); load {load_s:.1f} s, "
          f"synthesis {total_s:.2f} s, RTF {rtf:.3f}, first audio {first}", file=sys.stderr)
    return 0
