"""ModelScope as `model pull`'s other source, on its public HTTP API with
the standard library (the `modelscope` package is not needed):

    GET <endpoint>/api/v1/models/<repo>/repo/files?Revision=<rev>&Recursive=true
        -> {"Code": 200, "Data": {"Files": [{"Path", "Size", "Sha256", "Revision", "Type"}, ...]}}
    GET <endpoint>/api/v1/models/<repo>/repo?Revision=<rev>&FilePath=<path>   (Range requests)

The endpoint is --endpoint, else https://$MODELSCOPE_DOMAIN (as the modelscope
SDK reads it), else https://www.modelscope.cn. A file is fetched into
`<path>.incomplete` beside its place, resumed from its end with a Range
request, and renamed when complete; download.py checks it (sha256) as it
checks Hugging Face's. urllib honours HTTP(S)_PROXY / NO_PROXY."""

from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote, urlencode

from cosyedge_build.pull.hub import RepoFile
from cosyedge_models.errors import CosyEdgeError

DEFAULT_DOMAIN = "www.modelscope.cn"
TIMEOUT_S = 60.0
CHUNK = 1 << 20


def endpoint_url(endpoint: str | None) -> str:
    return (endpoint or f"https://{os.environ.get('MODELSCOPE_DOMAIN') or DEFAULT_DOMAIN}").rstrip("/")


def _get(url: str, headers: dict[str, str] | None = None) -> urllib.response.addinfourl:
    request = urllib.request.Request(url, headers={"User-Agent": "cosyedge", **(headers or {})})
    # an opener per request: its ProxyHandler reads HTTP(S)_PROXY now (urlopen's global one keeps the
    # environment of its first use)
    return urllib.request.build_opener().open(request, timeout=TIMEOUT_S)


def list_files(repo: str, revision: str, endpoint: str | None) -> tuple[str, list[RepoFile]]:
    """(commit, every file of the repository) at `revision`."""
    base = endpoint_url(endpoint)
    url = f"{base}/api/v1/models/{quote(repo)}/repo/files?" + urlencode({"Revision": revision, "Recursive": "true"})
    try:
        with _get(url) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise CosyEdgeError(f"no model repository {repo} (or no revision '{revision}') on {base}") from exc
        raise
    except ValueError as exc:
        raise CosyEdgeError(f"{url} did not answer JSON: {exc}") from exc
    data = answer.get("Data") if isinstance(answer, dict) else None
    if not isinstance(data, dict) or not isinstance(data.get("Files"), list):
        raise CosyEdgeError(f"{url} answered without a file list: {str(answer)[:200]}")
    blobs = [f for f in data["Files"] if f.get("Type", "blob") == "blob"]
    commit = next((str(f["Revision"]) for f in blobs if f.get("Revision")), revision)
    return commit, [RepoFile(str(f["Path"]), int(f["Size"]) if f.get("Size") is not None else None,
                             str(f["Sha256"]).lower() if f.get("Sha256") else None) for f in blobs]


def fetch_file(repo: str, revision: str, f: RepoFile, target: Path, endpoint: str | None) -> None:
    """Download one file of `revision` (a branch or tag) to `target`, resuming `<target>.incomplete`."""
    if target.is_file() and (f.size is None or target.stat().st_size == f.size):
        return
    url = f"{endpoint_url(endpoint)}/api/v1/models/{quote(repo)}/repo?" + urlencode(
        {"Revision": revision, "FilePath": f.path})
    part = target.with_name(target.name + ".incomplete")
    target.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.exists() else 0
    if f.size is not None and have > f.size:
        part.unlink()
        have = 0
    if f.size is None or have < f.size:
        try:
            response = _get(url, {"Range": f"bytes={have}-"} if have else None)
        except urllib.error.HTTPError as exc:
            if exc.code != 416:  # 416: nothing left to send
                raise
        else:
            with response, part.open("ab" if response.status == 206 else "wb") as out:
                shutil.copyfileobj(response, out, CHUNK)
    got = part.stat().st_size
    if f.size is not None and got != f.size:
        raise OSError(f"{f.path}: the connection ended after {got} of {f.size} bytes")
    part.replace(target)
