"""`cosyedge build export`: a CosyVoice 2 checkpoint directory to a model
bundle (models/BUNDLE.md): one ONNX graph per stage the device runs, the
embedding tables, the tokenizer, the carried ONNX models, the voices and
manifest.json. Written to a scratch folder beside `out` and renamed into
place at the end, so a failed export leaves nothing half-written."""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path

from models.errors import CosyEdgeError

log = logging.getLogger(__name__)


def export_bundle(model_dir: Path, out: Path) -> Path:
    from edge_build import reference
    from edge_build.export import (
        bundle,
        flow_encoder,
        flow_estimator,
        hift,
        hyperparams,
        llm,
        tokenizer,
        voices,
    )

    model_dir, out = Path(model_dir), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CosyEdgeError(f"{out} exists and is not an empty directory; give a new bundle directory")
    started = time.monotonic()
    refs = reference.load_reference(model_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    scratch.chmod(0o755)  # mkdtemp's 0700 would make the bundle private to the builder
    try:
        hyper = hyperparams.collect(refs)
        stages, arrays = llm.export_llm(refs.llm, scratch)
        stages.append(flow_encoder.export_flow_encoder(refs.flow, scratch))
        estimator_stage, noise = flow_estimator.export_flow_estimator(refs.flow, scratch)
        stages.append(estimator_stage)
        arrays["flow_noise"] = noise
        stages.extend(hift.export_hift(refs.hift, scratch))
        stages.extend(bundle.carry_onnx(model_dir, scratch))
        tok = tokenizer.export_tokenizer(model_dir, scratch)
        voice_map = voices.export_voices(model_dir, scratch, hyper["mel_bins"], tok[0])
        bundle.write_manifest(
            scratch,
            model_dir=model_dir,
            hyper=hyper,
            stages=stages,
            arrays=arrays,
            tokenizer=tok,
            voices=voice_map,
        )
        if out.exists():
            out.rmdir()  # empty (checked above)
        scratch.rename(out)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    log.info("exported %s to %s in %.1f s", model_dir, out, time.monotonic() - started)
    return out
