"""A local HTTP server that answers the requests `huggingface_hub` makes for
a model repository, standing where the hub would (HF_ENDPOINT or `endpoint=`),
and the two requests of ModelScope's HTTP API (edge_build/pull/modelscope.py):

* GET /api/models/<repo>/revision/<rev>[?blobs=true]: the model info, with
  `sha` and `siblings` (rfilename, size, blobId, lfs {sha256, size});
* HEAD and GET /<repo>/resolve/<rev>/<path>: ETag (git blob id, or the
  sha256 for LFS files with X-Linked-Etag / X-Linked-Size as the hub sends
  them before its CDN redirect), X-Repo-Commit, Content-Length, and Range
  requests (206 + Content-Range) for resumed downloads;
* 404 with X-Error-Code RepoNotFound / RevisionNotFound / EntryNotFound;
* ModelScope: GET /api/v1/models/<repo>/repo/files?Revision=..&Recursive=true
  ({"Code", "Data": {"Files": [{Path, Size, Sha256, Revision, Type}]}}) and
  GET /api/v1/models/<repo>/repo?Revision=..&FilePath=.. (Range as above).

Faults for the tests: serve a file corrupted (same length), or drop the
connection after some bytes of a file (a number of times). Every request is
recorded (method, path, Range)."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".pt", ".onnx", ".safetensors", ".zip", ".wav")


@dataclass
class Faults:
    corrupt: set[str] = field(default_factory=set)
    drop_after: dict[str, tuple[int, int]] = field(default_factory=dict)  # path -> (bytes, times)


@dataclass
class Repo:
    repo_id: str
    files: dict[str, bytes]
    commit: str = "c0ffee" + "0" * 34
    branches: tuple[str, ...] = ("main", "master")  # Hugging Face's default branch, ModelScope's

    def is_lfs(self, path: str) -> bool:
        return path.endswith(LFS_SUFFIXES)

    def blob_id(self, path: str) -> str:
        data = self.files[path]
        return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()

    def sibling(self, path: str) -> dict[str, object]:
        data = self.files[path]
        entry: dict[str, object] = {"rfilename": path, "size": len(data), "blobId": self.blob_id(path)}
        if self.is_lfs(path):
            entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry


TINY_REPO = "tests/CosyVoice2-tiny"
# files of the real repository that the export does not read: never downloaded
TINY_EXTRA = {"README.md": b"# CosyVoice2\n", "flow.encoder.fp32.zip": b"PK" + b"\0" * 4000,
              "asset/zero_shot_prompt.wav": b"RIFF" + b"\0" * 2000}


def tiny_hub(tiny_model_dir: Path) -> FakeHub:
    """The fake hub with the tiny checkpoint as TINY_REPO (use as a context manager)."""
    return FakeHub([repo_from_dir(TINY_REPO, tiny_model_dir, TINY_EXTRA)])


def repo_from_dir(repo_id: str, folder: Path, extra: dict[str, bytes] | None = None) -> Repo:
    files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
             if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)}
    files.update(extra or {})
    return Repo(repo_id, files)


class FakeHub:
    def __init__(self, repos: list[Repo]) -> None:
        self.repos = {r.repo_id: r for r in repos}
        self.faults = Faults()
        self.requests: list[tuple[str, str, str]] = []  # (method, path, Range header)
        self.proxied = 0  # requests that came as a proxy's (an absolute URL in the request line)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def downloads(self, path: str) -> list[str]:
        """The Range headers of the GETs of one file ('' for a whole-file GET), from either API."""
        ms = "FilePath=" + quote(path, safe="")
        with self._lock:
            return [r for m, p, r in self.requests if m == "GET" and (
                ("/resolve/" in p and p.endswith(f"/{path}")) or (p.endswith(ms) or f"{ms}&" in p))]

    def _record(self, method: str, path: str, rng: str) -> None:
        with self._lock:
            self.requests.append((method, path, rng))

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
                pass

            def do_HEAD(self) -> None:  # noqa: N802
                self._serve(head=True)

            def do_GET(self) -> None:  # noqa: N802
                self._serve(head=False)

            def _error(self, code: int, error_code: str, message: str) -> None:
                body = json.dumps({"error": message}).encode()
                self.send_response(code)
                self.send_header("X-Error-Code", error_code)
                self.send_header("X-Error-Message", message)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _serve(self, head: bool) -> None:
                if self.path.startswith("http://"):
                    with hub._lock:
                        hub.proxied += 1
                parts = urlsplit(self.path)
                path, query = unquote(parts.path), {k: v[0] for k, v in parse_qs(parts.query).items()}
                hub._record(self.command, path + (f"?{parts.query}" if parts.query else ""),
                            self.headers.get("Range", ""))
                if path.startswith("/api/v1/models/"):  # ModelScope
                    rest = path.removeprefix("/api/v1/models/")
                    if rest.endswith("/repo/files"):
                        self._ms_files(rest.removesuffix("/repo/files"), query.get("Revision", "master"))
                    elif rest.endswith("/repo"):
                        repo = self._repo(rest.removesuffix("/repo"), query.get("Revision", "master"))
                        if repo is not None:
                            self._send_file(repo, query.get("FilePath", ""), head)
                    else:
                        self._error(404, "NotFound", f"no route {path}")
                elif path.startswith("/api/models/"):
                    self._model_info(path.removeprefix("/api/models/"))
                elif "/resolve/" in path:
                    repo_id, _, rest = path.lstrip("/").partition("/resolve/")
                    revision, _, file_path = rest.partition("/")
                    self._resolve(repo_id, revision, file_path, head)
                else:
                    self._error(404, "NotFound", f"no route {path}")

            def _repo(self, repo_id: str, revision: str) -> Repo | None:
                repo = hub.repos.get(repo_id)
                if repo is None:
                    self._error(404, "RepoNotFound", "Repository not found")
                    return None
                if revision not in (repo.commit, *repo.branches):
                    self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                    return None
                return repo

            def _model_info(self, rest: str) -> None:
                repo_id, _, revision = rest.partition("/revision/")
                repo = self._repo(repo_id, revision or "main")
                if repo is None:
                    return
                body = json.dumps({"id": repo.repo_id, "modelId": repo.repo_id, "sha": repo.commit,
                                   "private": False, "tags": [],
                                   "siblings": [repo.sibling(p) for p in repo.files]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _ms_files(self, repo_id: str, revision: str) -> None:
                repo = self._repo(repo_id, revision)
                if repo is None:
                    return
                files = [{"Name": p.rpartition("/")[2], "Path": p, "Size": len(d), "Type": "blob",
                          "Sha256": hashlib.sha256(d).hexdigest(), "Revision": repo.commit}
                         for p, d in repo.files.items()]
                folders = sorted({p.rpartition("/")[0] for p in repo.files if "/" in p})
                files += [{"Name": f, "Path": f, "Size": 0, "Type": "tree", "Sha256": "", "Revision": repo.commit}
                          for f in folders]
                body = json.dumps({"Code": 200, "Data": {"Files": files}, "Success": True}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _resolve(self, repo_id: str, revision: str, file_path: str, head: bool) -> None:
                repo = self._repo(repo_id, revision)
                if repo is not None:
                    self._send_file(repo, file_path, head)

            def _send_file(self, repo: Repo, file_path: str, head: bool) -> None:
                if file_path not in repo.files:
                    self._error(404, "EntryNotFound", f"{file_path} does not exist")
                    return
                data = repo.files[file_path]
                if file_path in hub.faults.corrupt:
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                start = 0
                rng = self.headers.get("Range", "")
                if rng.startswith("bytes=") and not head:
                    start = int(rng.removeprefix("bytes=").split("-")[0])
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", repo.commit)
                if repo.is_lfs(file_path):
                    sha = hashlib.sha256(repo.files[file_path]).hexdigest()
                    self.send_header("X-Linked-Etag", f'"{sha}"')
                    self.send_header("X-Linked-Size", str(len(data)))
                    self.send_header("ETag", f'"{repo.blob_id(file_path)}"')
                else:
                    self.send_header("ETag", f'"{repo.blob_id(file_path)}"')
                self.send_header("Accept-Ranges", "bytes")
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                if head:
                    return
                body = data[start:]
                drop = hub.faults.drop_after.get(file_path)
                if drop is not None and drop[1] > 0:
                    hub.faults.drop_after[file_path] = (drop[0], drop[1] - 1)
                    cut = max(0, drop[0] - start)
                    self.wfile.write(body[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)  # the peer sees the connection end mid-body
                    return
                self.wfile.write(body)

        return Handler
