"""`model pull`'s stages, one after another in a work folder beside the
bundles (same filesystem: the result is installed by a rename):

    <work>/state.json       the repository, revision and commit; `downloaded` once every file is checked
    <work>/checkpoint/      the download (resumed by huggingface_hub, files checked: download.py)
    <work>/fp32/            `build export` (written atomically: present = done)
    <work>/<precision>/     `build quantize` (idem), and its TensorRT engines when asked

A second run after an interruption anywhere skips what is done: a finished
download does not ask the hub again, a finished export is not redone. One
pull at a time per work folder (a lock)."""

from __future__ import annotations

import fcntl
import json
import logging
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cosyedge_build.pull import resources
from cosyedge_build.pull.download import download_checkpoint, list_files, missing_bytes
from cosyedge_build.pull.hub import RepoFile
from cosyedge_build.quantize.memory import available_bytes
from cosyedge_models.errors import CosyEdgeError

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "fp16", "int8", "int8w")
STATE = "state.json"


def choose_precision(requested: str, tensorrt: bool, cuda: bool) -> str:
    """auto: int8 (Q/DQ) for TensorRT, fp16 for onnxruntime on a GPU, fp32 on a CPU."""
    if requested != "auto":
        if requested not in PRECISIONS:
            raise CosyEdgeError(f"unknown precision '{requested}'; allowed: auto, {', '.join(PRECISIONS)}")
        return requested
    return "int8" if tensorrt else ("fp16" if cuda else "fp32")


def backend_for(precision: str, engines: bool, cuda: bool) -> str:
    """The [tts] backend that runs the pulled bundle here."""
    if engines:
        return "trt"
    return "ort-cuda" if cuda and precision != "int8" else "ort"


@dataclass(frozen=True)
class PullJob:
    repo: str
    revision: str
    source: str
    precision: str  # one of PRECISIONS
    engines: bool  # build TensorRT engines into the bundle
    work: Path
    endpoint: str | None = None
    progress: bool | None = None  # progress bars (default: on a terminal)
    check_resources: bool = True


@dataclass(frozen=True)
class PullResult:
    bundle: Path  # inside job.work, complete
    record: dict[str, Any]  # what pull.json keeps beside the installed bundle


@contextmanager
def _locked(work: Path) -> Iterator[None]:
    work.mkdir(parents=True, exist_ok=True)
    with (work / ".lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise CosyEdgeError(f"another `cosyedge model pull` is working in {work}; wait for it") from exc
        yield


def _read_state(work: Path) -> dict[str, Any]:
    try:
        state = json.loads((work / STATE).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _write_state(work: Path, state: dict[str, Any]) -> None:
    tmp = work / f"{STATE}.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(work / STATE)


def _done(folder: Path) -> bool:
    return (folder / "manifest.json").is_file()


def _clean_partials(work: Path) -> None:
    """Scratch folders of a build killed mid-way (an exception removes its own)."""
    for entry in work.iterdir():
        if entry.is_dir() and entry.name.startswith(".") and ".partial" in entry.name:
            shutil.rmtree(entry, ignore_errors=True)


def run_pull(job: PullJob, on_stage: Callable[[str], None] | None = None) -> PullResult:
    """Run the stages that are not done yet; `on_stage(name)` after each one."""
    if job.precision not in PRECISIONS:
        raise CosyEdgeError(f"unknown precision '{job.precision}'; allowed: {', '.join(PRECISIONS)}")
    with _locked(job.work):
        _clean_partials(job.work)
        state = _read_state(job.work)
        ckpt, fp32, final = job.work / "checkpoint", job.work / "fp32", job.work / job.precision
        same = (state.get("source", "huggingface"), state.get("repo")) == (job.source, job.repo) and \
            job.revision in (state.get("revision"), state.get("commit"))
        if same and state.get("downloaded"):
            commit = str(state["commit"])
            files = [RepoFile(**f) for f in state["files"]]
            log.info("checkpoint %s@%s: downloaded before", job.repo, commit[:12])
        else:
            commit, files = list_files(job.repo, job.revision, job.endpoint, job.source)
            if state and (state.get("repo") != job.repo or state.get("commit") != commit
                          or state.get("source", "huggingface") != job.source):
                log.info("%s: another repository or commit than the last pull's: starting over", job.work)
                for entry in job.work.iterdir():
                    if entry.name != ".lock":
                        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            state = {"source": job.source, "repo": job.repo, "revision": job.revision, "commit": commit,
                     "files": [asdict(f) for f in files], "downloaded": False}
            _write_state(job.work, state)
        if job.check_resources:
            needs = resources.estimate(files, job.precision, job.engines and not _has_engines(final),
                                       0 if state.get("downloaded") else missing_bytes(ckpt, files, commit),
                                       _done(fp32) or _done(final), _done(final) or job.precision == "fp32")
            resources.check(needs, job.work, free_memory=available_bytes())
        if not state.get("downloaded"):
            # ModelScope serves files by branch or tag name (its listing's Revision field is not always one)
            revision = commit if job.source == "huggingface" else job.revision
            download_checkpoint(job.repo, revision, ckpt, job.endpoint, job.progress, listing=(commit, files),
                                source=job.source)
            state["downloaded"] = True
            _write_state(job.work, state)
        _stage(on_stage, "download")
        if not _done(final) and not _done(fp32):
            from cosyedge_build.export import export_bundle

            started = time.monotonic()
            export_bundle(ckpt, fp32)
            log.info("exported the checkpoint to %s in %.0f s", fp32, time.monotonic() - started)
        _stage(on_stage, "export")
        if job.precision != "fp32" and not _done(final):
            _quantize(fp32, final, job.precision)
        _stage(on_stage, "quantize")
        if job.engines and not _has_engines(final):
            from cosyedge_build.tensorrt.engines import EngineBuildSettings, build_engines

            build_engines(final, EngineBuildSettings(), progress=log.info)
        _stage(on_stage, "engines")
        record = {"source": job.source, "repo": job.repo, "revision": job.revision, "commit": commit,
                  "precision": job.precision, "engines": _has_engines(final),
                  "pulled": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        return PullResult(final, record)


def _stage(on_stage: Callable[[str], None] | None, name: str) -> None:
    log.info("pull: %s done", name)
    if on_stage is not None:
        on_stage(name)


def _has_engines(bundle: Path) -> bool:
    try:
        return bool(json.loads((bundle / "manifest.json").read_text()).get("engines"))
    except (OSError, ValueError):
        return False


def _quantize(fp32: Path, out: Path, precision: str) -> None:
    from cosyedge_build.quantize.pipeline import QuantizeBudgetError, quantize_bundle
    from cosyedge_build.quantize.settings import QuantizeSettings

    started = time.monotonic()
    try:
        quantize_bundle(fp32, out, QuantizeSettings(precision=precision))
    except QuantizeBudgetError as exc:
        raise CosyEdgeError(f"the {precision} bundle misses the accuracy budget ({exc}); pull --precision fp32 "
                            "or fp16, or run `cosyedge build quantize` by hand with --force (docs/quantization.md)"
                            ) from exc
    log.info("quantized to %s in %.0f s", precision, time.monotonic() - started)
