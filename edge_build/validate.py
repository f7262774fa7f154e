"""`cosyedge build validate --bundle B [--model-dir DIR]`: is this bundle
intact, loadable, and still the model it was exported from?

Checks, in order: the manifest; every file's sha256 against the manifest;
every stage loads in ONNX Runtime with the manifest's input/output names; a
short offline and streaming synthesis gives finite audio; and, when the
source checkpoint is available, the whole pipeline against the official
PyTorch pipeline on it (same speech tokens under one seeded sampler, and
the offline waveform's SNR with the vocoder noise drawn as upstream draws
it)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
from cosyedge_models.backends.ort import OrtBackend
from cosyedge_models.bundle.loader import load_bundle, sha256_file
from cosyedge_models.errors import CosyEdgeError
from cosyedge_models.synthesis.api import SynthesisRequest
from cosyedge_models.synthesis.synthesizer import load_synthesizer

TEXT = "Validation of the exported bundle, one two three."
SEED = 3


class TorchNoise:
    """The vocoder noise exactly as upstream's SineGen2 draws it (torch's
    global generator; randn_like of a transposed view)."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch

    def standard_normal(self, size: tuple[int, ...], dtype: type[np.float32]) -> np.ndarray:
        torch = self.torch
        b, n, h = size
        torch.rand(b, h)
        noise = torch.randn_like(torch.empty(b, h, n).transpose(1, 2))
        torch.randn_like(torch.empty(b, 1, n).transpose(1, 2))
        return np.ascontiguousarray(noise.numpy(), dtype=dtype)


def check_files(bundle_dir: Path, manifest: dict[str, Any]) -> list[str]:
    bad = []
    for rel, digest in manifest.get("files", {}).items():
        path = bundle_dir / rel
        if not path.exists():
            bad.append(f"{rel}: missing")
        elif sha256_file(path) != digest:
            bad.append(f"{rel}: sha256 differs from the manifest")
    return bad


def compare_with_reference(bundle_dir: Path, model_dir: Path) -> dict[str, Any]:
    import cosyedge_build.reference.pipeline as rp
    import torch
    from cosyedge_models.synthesis.llm import LlmInput
    from cosyedge_models.synthesis.prompt import PromptFeatures
    from cosyedge_models.synthesis.sampling import TokenSampler

    engine = load_synthesizer(bundle_dir)
    try:
        engine.noise_factory = lambda _seq: TorchNoise(torch)  # type: ignore[method-assign,assignment]
        refs = rp.load_reference(model_dir)
        model = rp.official_model(refs)
        ids = engine.frontend.prepare(TEXT)[0].token_ids.tolist()

        def sampler() -> TokenSampler:
            seq = np.random.SeedSequence(SEED).spawn(2)[0]
            return TokenSampler(engine.bundle.llm.sampling, engine.bundle.llm.eos_token, np.random.default_rng(seq))

        ours_tokens = list(engine.lm.generate(LlmInput(text=ids), sampler()))
        undo = rp.patch_sampling(refs.llm, sampler().ras)
        try:  # upstream's LLM alone, under the same seeded sampler: the same speech tokens
            text, empty = torch.tensor([ids], dtype=torch.int32), torch.zeros(1, 0, dtype=torch.int32)
            zero = torch.tensor([0], dtype=torch.int32)
            their_tokens = [int(t) for t in refs.llm.inference(
                text=text, text_len=torch.tensor([len(ids)], dtype=torch.int32), prompt_text=empty,
                prompt_text_len=zero, prompt_speech_token=empty, prompt_speech_token_len=zero,
                embedding=torch.zeros(1, 192))]
        finally:
            undo()
        assert engine.bundle.default_voice is not None
        voice = PromptFeatures.load(engine.bundle.voices[engine.bundle.default_voice])
        undo = rp.patch_sampling(refs.llm, sampler().ras)
        try:
            torch.manual_seed(11)
            ref = np.concatenate(list(rp.synthesize(model, rp.model_inputs(voice, ids), stream=False)))
        finally:
            undo()
        torch.manual_seed(11)
        ours = np.concatenate([c.pcm for c in engine.synthesize(SynthesisRequest(text=TEXT, stream=False,
                                                                                 seed=SEED))])
    finally:
        engine.close()
    n = min(ours.size, ref.size)
    err = float(np.sum((ours[:n] - ref[:n]) ** 2))
    snr = float("inf") if err == 0 else 10 * np.log10(float(np.sum(ref[:n] ** 2)) / err)
    return {"tokens": len(ours_tokens), "same_tokens": ours_tokens == their_tokens,
            "same_length": ours.size == ref.size, "snr_db": round(snr, 1)}


def validate_command(args: argparse.Namespace) -> int:
    bundle_dir = Path(args.bundle)
    bundle = load_bundle(bundle_dir)
    problems = check_files(bundle_dir, bundle.manifest)
    print(f"manifest: format {bundle.manifest['format_version']}, {bundle.family}, {bundle.precision}")
    print(f"files: {len(bundle.manifest.get('files', {}))} checked, {len(problems)} bad")
    for p in problems:
        print(f"  {p}")
    cpu = OrtBackend(providers=("CPUExecutionProvider",))
    for stage, info in bundle.stages.items():
        session = cpu.load(stage, info.path)
        want = [i["name"] for i in info.raw.get("inputs", [])]
        if want and list(session.input_names) != want:
            problems.append(f"{stage}: inputs {list(session.input_names)}, manifest says {want}")
        session.close()
    print(f"stages: {len(bundle.stages)} load in ONNX Runtime")
    engine = load_synthesizer(bundle_dir)
    try:
        for stream in (False, True):
            pcm = np.concatenate([c.pcm for c in engine.synthesize(SynthesisRequest(text=TEXT, stream=stream,
                                                                                    seed=SEED))])
            ok = pcm.size > 0 and bool(np.isfinite(pcm).all())
            print(f"synthesis ({'streaming' if stream else 'offline'}): {pcm.size / engine.sample_rate:.2f} s, "
                  f"{'finite' if ok else 'NOT FINITE'}")
            if not ok:
                problems.append("synthesis produced no or non-finite audio")
    finally:
        engine.close()
    model_dir = Path(args.model_dir) if args.model_dir else Path(bundle.manifest.get("source", {}).get("model_dir", ""))
    if bundle.precision != "fp32":
        print(f"{bundle.precision} bundle: its accuracy against fp32 is in quantize_report.json")
    elif model_dir and (model_dir / "cosyvoice2.yaml").exists():
        result = compare_with_reference(bundle_dir, model_dir)
        print(f"official pipeline on {model_dir}: {result['tokens']} speech tokens, same tokens "
              f"{result['same_tokens']}, same length {result['same_length']}, waveform SNR {result['snr_db']} dB")
        if not result["same_tokens"]:
            problems.append("the speech tokens differ from the official LLM's under the same sampler")
        if not result["same_length"] or result["snr_db"] < 40.0:
            problems.append(f"differs from the official pipeline (SNR {result['snr_db']} dB, need >= 40)")
    else:
        print(f"source checkpoint not found ({model_dir or 'no path in the manifest'}): "
              "skipped the comparison with the official pipeline; pass --model-dir")
    if problems:
        raise CosyEdgeError("bundle failed validation: " + "; ".join(problems))
    print("bundle OK")
    return 0
