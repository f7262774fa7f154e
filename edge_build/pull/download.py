"""The download of `model pull` from Hugging Face (or a mirror: HF_ENDPOINT),
through `huggingface_hub`: the repository's file list with sizes and hashes
at one commit, then each needed file into the checkpoint folder.

huggingface_hub resumes a file from its `.incomplete` part (an HTTP Range
request; it also retries a connection dropped mid-file), skips a file it
already fetched at that commit, and honours HF_ENDPOINT, HF_TOKEN and the
HTTP(S)_PROXY variables (requests). Each file is then checked here against
the hub's size and hash (LFS: sha256; others: git's blob id) and recorded in
`.cosyedge-verified.json`, so a second run neither downloads nor re-hashes
what is done."""

from __future__ import annotations

import http.client
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosyedge_build.pull import modelscope
from cosyedge_build.pull.hub import ChecksumError, RepoFile, needed_files, verify
from cosyedge_models.errors import CosyEdgeError, MissingExtraError

log = logging.getLogger(__name__)

VERIFIED = ".cosyedge-verified.json"
MANUAL_STEPS = ("on a machine without access to the hub, download the checkpoint elsewhere "
                "(git lfs clone https://huggingface.co/FunAudioLLM/CosyVoice2-0.5B) and build the bundle with "
                "`cosyedge build export --model-dir DIR --out BUNDLE` (docs/models.md, 'Without network')")


class HubUnreachableError(CosyEdgeError):
    """The hub (or mirror) could not be reached or refused the request."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    repo: str
    revision: str
    commit: str
    files: tuple[RepoFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size or 0 for f in self.files)


def _hub() -> Any:
    try:  # the submodules too: the package resolves its attributes lazily
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
        import huggingface_hub.utils
    except ImportError as exc:
        raise MissingExtraError("huggingface_hub", "build", "downloading a checkpoint (cosyedge model pull)") from exc
    return huggingface_hub


def _endpoint(hub: Any, endpoint: str | None) -> str:
    return endpoint or str(hub.constants.ENDPOINT)


def _unreachable(hub: Any, endpoint: str | None, exc: BaseException, what: str) -> HubUnreachableError:
    return HubUnreachableError(f"{what} from {_endpoint(hub, endpoint)} failed: {type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''}. Check the network, a proxy "
                               f"(HTTPS_PROXY) or a mirror (HF_ENDPOINT); {MANUAL_STEPS}")


_MS_ERRORS = (OSError, http.client.HTTPException)  # urllib's URLError/HTTPError are OSErrors


def _ms_unreachable(endpoint: str | None, exc: BaseException, what: str) -> HubUnreachableError:
    return HubUnreachableError(f"{what} from {modelscope.endpoint_url(endpoint)} failed: {type(exc).__name__}: "
                               f"{exc}. Check the network, a proxy (HTTPS_PROXY) or the endpoint "
                               f"(MODELSCOPE_DOMAIN); {MANUAL_STEPS}")


def _request_errors(hub: Any) -> tuple[type[BaseException], ...]:
    import requests  # huggingface_hub's own HTTP client

    return (requests.RequestException, OSError, hub.errors.HfHubHTTPError, hub.errors.LocalEntryNotFoundError)


def list_files(repo: str, revision: str, endpoint: str | None = None,
               source: str = "huggingface") -> tuple[str, list[RepoFile]]:
    """(commit, needed files) of `repo` at `revision` (a branch, tag or commit)."""
    if source == "modelscope":
        try:
            commit, every = modelscope.list_files(repo, revision, endpoint)
        except _MS_ERRORS as exc:
            raise _ms_unreachable(endpoint, exc, f"reading the file list of {repo}") from exc
        return commit, needed_files(every, repo)
    hub = _hub()
    errors = hub.errors
    try:
        info = hub.HfApi(endpoint=endpoint).model_info(repo, revision=revision, files_metadata=True)
    except errors.RevisionNotFoundError as exc:
        raise CosyEdgeError(f"{repo} has no revision '{revision}' on {_endpoint(hub, endpoint)}") from exc
    except errors.RepositoryNotFoundError as exc:
        raise CosyEdgeError(f"no model repository {repo} on {_endpoint(hub, endpoint)} (or it is private: "
                            "set HF_TOKEN)") from exc
    except _request_errors(hub) as exc:
        raise _unreachable(hub, endpoint, exc, f"reading the file list of {repo}") from exc
    files = [RepoFile(s.rfilename, s.lfs.size if s.lfs else s.size, s.lfs.sha256 if s.lfs else None,
                      None if s.lfs else s.blob_id) for s in info.siblings or []]
    return str(info.sha), needed_files(files, repo)


def missing_bytes(folder: Path, files: list[RepoFile], commit: str) -> int:
    """What a download into `folder` still has to fetch (a part on disk counts as fetched)."""
    verified = _read_verified(folder)
    done = set(verified) if verified.get("commit") == commit else set()
    return sum(f.size or 0 for f in files if f.path not in done)


def _read_verified(folder: Path) -> dict[str, str]:
    try:
        data = json.loads((folder / VERIFIED).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def download_checkpoint(repo: str, revision: str, folder: Path, endpoint: str | None = None,
                        progress: bool | None = None,
                        on_file: Callable[[RepoFile], None] | None = None,
                        listing: tuple[str, list[RepoFile]] | None = None,
                        source: str = "huggingface") -> Checkpoint:
    """Download the needed files of `repo` at `revision` into `folder`
    (resuming what an earlier run left there) and check each one.
    `progress`: huggingface_hub's progress bars (default: on a terminal);
    without them (and from ModelScope) one log line per file. `listing`:
    list_files' answer, when the caller asked for it already."""
    commit, files = listing or list_files(repo, revision, endpoint, source)
    folder.mkdir(parents=True, exist_ok=True)
    verified = _read_verified(folder)
    if verified.get("commit") != commit:
        verified = {"commit": commit}

    def fetch_ms(f: RepoFile) -> None:
        try:
            modelscope.fetch_file(repo, revision, f, folder / f.path, endpoint)
        except _MS_ERRORS as exc:
            raise _ms_unreachable(endpoint, exc, f"downloading {f.path} of {repo}") from exc

    if source == "modelscope":
        _each_file(folder, files, verified, fetch_ms, on_file)
        return Checkpoint(folder, repo, revision, commit, tuple(files))
    hub = _hub()

    def fetch_hf(f: RepoFile) -> None:
        try:
            hub.hf_hub_download(repo, f.path, revision=commit, local_dir=folder, endpoint=endpoint)
        except hub.errors.EntryNotFoundError as exc:
            raise CosyEdgeError(f"{repo}@{commit[:12]} lists {f.path} but does not serve it: {exc}") from exc
        except _request_errors(hub) as exc:
            raise _unreachable(hub, endpoint, exc, f"downloading {f.path} of {repo}") from exc

    bars = sys.stderr.isatty() if progress is None else progress
    was_disabled = hub.utils.are_progress_bars_disabled()
    if not bars:
        hub.utils.disable_progress_bars()
    try:
        _each_file(folder, files, verified, fetch_hf, on_file)
    finally:
        if not bars and not was_disabled:
            hub.utils.enable_progress_bars()
    return Checkpoint(folder, repo, revision, commit, tuple(files))


def _each_file(folder: Path, files: list[RepoFile], verified: dict[str, str],
               fetch: Callable[[RepoFile], None], on_file: Callable[[RepoFile], None] | None) -> None:
    for index, f in enumerate(files, 1):
        _one_file(folder, f, fetch, verified, f"{index}/{len(files)}")
        if on_file is not None:
            on_file(f)


def _one_file(folder: Path, f: RepoFile, fetch: Callable[[RepoFile], None], verified: dict[str, str],
              count: str) -> None:
    target = folder / f.path
    if verified.get(f.path) and target.is_file() and (f.size is None or target.stat().st_size == f.size):
        log.info("%s %s: downloaded and checked before", count, f.path)
        return
    started = time.monotonic()
    fetch(f)
    try:
        digest = verify(target, f, "the hub")
    except ChecksumError:
        target.unlink(missing_ok=True)
        raise
    verified[f.path] = digest or "unchecked"
    tmp = folder / f"{VERIFIED}.tmp"
    tmp.write_text(json.dumps(verified, indent=1))
    tmp.replace(folder / VERIFIED)
    size = target.stat().st_size
    log.info("%s %s: %.1f MB in %.1f s%s", count, f.path, size / 1e6, time.monotonic() - started,
             ", " + ("sha256" if f.sha256 else "git blob id") + " checked" if digest else ", no hash published")
