"""`cosyedge triton --bundle DIR`: a local Triton Inference Server on the
model repository in cloud_bridge/model_repository, for development and
tests.

The server binary: `tritonserver` on PATH (NVIDIA's container or a system
install), else the one the PyPI package nvidia-pytriton ships, looked for in
$COSYEDGE_TRITON_VENV, then `.venv-triton` beside this checkout (made by
.ci/setup.d/triton.sh), then the running interpreter. For the pytriton build
it prepares what pytriton itself would: a backend directory holding the
Python-backend stub built for that venv's Python version, LD_LIBRARY_PATH
with that Python's libpython directory and the package's bundled libraries,
and the venv's bin/ first on PATH (the stub finds its interpreter there, so
the model runs with the venv's numpy < 2 and onnxruntime).

The repository is copied to a work directory where every version directory
of the model gets a `bundle` link (the model loads the bundle from there).
The server runs with `--model-control-mode=explicit`; the model is loaded
through the model control API (tritonclient `load_model`) once the server is
live, and unloaded before the server stops.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from cosyedge_cloud.triton.batching_config import DynamicBatching, apply_batching
from cosyedge_cloud.triton.proc_guard import die_with_parent
from cosyedge_models.errors import BundleError, CosyEdgeError, MissingExtraError

log = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # cloud_bridge/
REPOSITORY = PACKAGE_DIR / "model_repository"
CHECKOUT = PACKAGE_DIR.parent


class TritonError(CosyEdgeError):
    """The server cannot be found, started or made ready."""


@dataclass(frozen=True)
class ServerDist:
    binary: Path
    backends_src: Path | None = None  # pytriton's backends/ (None: the server's own default)
    python_stub: Path | None = None  # pytriton: the stub for the venv's Python version
    lib_dirs: tuple[Path, ...] = ()  # prepended to LD_LIBRARY_PATH
    bin_dir: Path | None = None  # prepended to PATH (the stub's Python)
    origin: str = ""


_PROBE = """
import importlib.util, json, sys, sysconfig
spec = importlib.util.find_spec("pytriton")
print(json.dumps({"pytriton": list(spec.submodule_search_locations) if spec else None,
                  "libdir": sysconfig.get_config_var("LIBDIR"),
                  "shared": bool(sysconfig.get_config_var("Py_ENABLE_SHARED")),
                  "version": "%d.%d" % sys.version_info[:2], "bin": sysconfig.get_path("scripts")}))
"""


def _pytriton_dist(python: Path, origin: str) -> ServerDist | None:
    try:
        out = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True, timeout=60, check=True)
        info = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError):
        return None
    if not info["pytriton"]:
        return None
    pkg = Path(info["pytriton"][0])
    server = pkg / "tritonserver"
    stub = server / "python_backend_stubs" / info["version"] / "triton_python_backend_stub"
    binary = server / "bin" / "tritonserver"
    if not binary.exists():
        return None
    if not stub.exists():
        raise TritonError(f"nvidia-pytriton in {origin} has no Python backend stub for Python {info['version']}")
    if not info["shared"]:
        raise TritonError(
            f"the Python of {origin} is not a shared-library build (no libpython): the Triton "
            "Python backend cannot run on it"
        )
    libs = [Path(info["libdir"]), pkg.parent / "nvidia_pytriton.libs"]
    return ServerDist(
        binary=binary,
        backends_src=server / "backends",
        python_stub=stub,
        lib_dirs=tuple(p for p in libs if p.is_dir()),
        bin_dir=Path(info["bin"]),
        origin=origin,
    )


def find_server() -> ServerDist:
    on_path = shutil.which("tritonserver")
    if on_path:
        return ServerDist(binary=Path(on_path), origin="PATH")
    candidates: list[tuple[Path, str]] = []
    if os.environ.get("COSYEDGE_TRITON_VENV"):
        venv = Path(os.environ["COSYEDGE_TRITON_VENV"])
        candidates.append((venv / "bin" / "python", f"$COSYEDGE_TRITON_VENV ({venv})"))
    candidates.append((CHECKOUT / ".venv-triton" / "bin" / "python", str(CHECKOUT / ".venv-triton")))
    import sys

    candidates.append((Path(sys.executable), f"this Python ({sys.executable})"))
    for python, origin in candidates:
        if python.exists():
            dist = _pytriton_dist(python, origin)
            if dist is not None:
                return dist
    raise TritonError(
        "no tritonserver: none on PATH and no nvidia-pytriton in $COSYEDGE_TRITON_VENV, "
        f"{CHECKOUT / '.venv-triton'} or this Python; run .ci/setup.d/triton.sh (or .ci/setup)"
    )


@dataclass(frozen=True)
class LaunchSettings:
    bundle: Path | None = None  # every version's bundle unless version_bundles names one
    version_bundles: dict[str, Path] = field(default_factory=dict)  # "2" -> another bundle (a canary)
    versions: tuple[str, ...] = ()  # only these of the model's versions are served (empty: every one)
    model: str = "cosyvoice2"  # the model whose versions get the bundle links
    extra_models: tuple[str, ...] = ()  # more models of the repository to load (they name their own bundles)
    repository: Path = REPOSITORY
    parameters: dict[str, str] = field(default_factory=dict)  # override the model's config parameters
    batching: DynamicBatching = DynamicBatching()  # Triton's dynamic batching (batching_config.py)
    address: str = "127.0.0.1"
    grpc_port: int = 8001
    http_port: int = 8000
    metrics_port: int = 8002
    workdir: Path | None = None  # None: a temporary directory, removed at stop
    log_file: Path | None = None  # None: the server logs to this process's stderr
    ready_timeout_s: float = 120.0
    exit_timeout_s: int = 5  # the server waits this long for open client connections at shutdown
    load_model: bool = True
    die_with_parent: bool = False  # the server gets SIGTERM when the starting thread ends (the CLI's main)

    def __post_init__(self) -> None:
        for name in ("grpc_port", "http_port", "metrics_port"):
            port = getattr(self, name)
            if not 1 <= port <= 65535:
                raise TritonError(f"{name.replace('_', '-')} must be a TCP port 1-65535, got {port}")
        for version in self.version_bundles:
            if not version.isdigit():
                raise TritonError(f"version bundles are keyed by version number, got {version!r}")
        for version in self.versions:
            if not version.isdigit():
                raise TritonError(f"versions are version numbers (the model's folders 1, 2, ...), got {version!r}")
        bundles = ([self.bundle] if self.bundle else []) + list(self.version_bundles.values())
        for bundle in bundles:
            if not Path(bundle).is_dir():
                raise BundleError(
                    f"model bundle {bundle} is not a directory (build one with "
                    "`cosyedge build export`, or `cosyedge build tiny` then export)"
                )


def prepare_repository(settings: LaunchSettings, target: Path) -> Path:
    """Copy the repository and link each version's bundle; returns the copy."""
    if not (settings.repository / settings.model / "config.pbtxt").exists():
        raise TritonError(f"{settings.repository} has no model {settings.model!r} (no config.pbtxt)")
    repo = target / "model_repository"
    if repo.exists():
        shutil.rmtree(repo)
    shutil.copytree(settings.repository, repo, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    model_dir = repo / settings.model
    found = model_versions(model_dir)
    missing = [v for v in settings.versions if v not in found]
    if missing:
        raise TritonError(f"model {settings.model!r} has no version {', '.join(missing)}; it has {', '.join(found)}")
    for version in found:
        if settings.versions and version not in settings.versions:
            # not served: each version loads its own engine (at full size on a GPU, its graphs and lanes)
            shutil.rmtree(model_dir / version)
            continue
        bundle = settings.version_bundles.get(version, settings.bundle)
        link = model_dir / version / "bundle"
        if bundle is not None:
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(Path(bundle).resolve(), target_is_directory=True)
    config = model_dir / "config.pbtxt"
    if settings.batching != DynamicBatching():
        config.write_text(apply_batching(config.read_text(), settings.batching))
    if settings.parameters:
        config.write_text(set_parameters(config.read_text(), settings.parameters))
    return repo


def model_versions(model_dir: Path) -> list[str]:
    """The version folders of a model in the repository, in number order ("1", "2", ...)."""
    return sorted((p.name for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=int)


def set_parameters(config: str, parameters: dict[str, str]) -> str:
    """config.pbtxt with the string parameters replaced (or added)."""
    for key, value in parameters.items():
        line = f'parameters: {{ key: "{key}" value: {{ string_value: {json.dumps(value)} }} }}'
        pattern = re.compile(r'^parameters:\s*\{\s*key:\s*"' + re.escape(key) + r'".*$', re.M)
        if pattern.search(config):
            # a replacement string: its backslashes (from JSON escapes) must be doubled
            config = pattern.sub(line.replace("\\", "\\\\"), config)
        else:
            config += "\n" + line + "\n"
    return config


def _prepare_backends(dist: ServerDist, target: Path) -> Path | None:
    if dist.backends_src is None or dist.python_stub is None:
        return None
    backends = target / "backends"
    if backends.exists():
        shutil.rmtree(backends)
    python_dir = backends / "python"
    python_dir.mkdir(parents=True)
    for item in (dist.backends_src / "python").iterdir():
        (python_dir / item.name).symlink_to(item)
    shutil.copy2(dist.python_stub, python_dir / "triton_python_backend_stub")
    return backends


class TritonServer:
    """One tritonserver process; a context manager (start, stop)."""

    def __init__(self, settings: LaunchSettings, dist: ServerDist | None = None) -> None:
        self.settings = settings
        self.dist = dist or find_server()
        self._own_workdir = settings.workdir is None
        self.workdir = (
            Path(tempfile.mkdtemp(prefix="cosyedge-triton-")) if settings.workdir is None else settings.workdir
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: TextIO | None = None
        self.repository: Path | None = None

    @property
    def grpc_url(self) -> str:
        return f"{self.settings.address}:{self.settings.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.settings.address}:{self.settings.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.settings.address}:{self.settings.metrics_port}/metrics"

    def command(self, backends: Path | None) -> list[str]:
        s = self.settings
        cmd = [
            str(self.dist.binary),
            f"--model-repository={self.repository}",
            "--model-control-mode=explicit",
            f"--grpc-address={s.address}",
            f"--grpc-port={s.grpc_port}",
            f"--http-address={s.address}",
            f"--http-port={s.http_port}",
            f"--metrics-address={s.address}",
            f"--metrics-port={s.metrics_port}",
            "--allow-metrics=true",
            "--allow-gpu-metrics=false",
            f"--exit-timeout-secs={s.exit_timeout_s}",
            "--strict-readiness=true",
        ]
        if backends is not None:
            cmd.append(f"--backend-directory={backends}")
        return cmd

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.dist.lib_dirs:
            parts = [str(p) for p in self.dist.lib_dirs] + (
                [env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else []
            )
            env["LD_LIBRARY_PATH"] = ":".join(parts)
        if self.dist.bin_dir is not None:
            env["PATH"] = f"{self.dist.bin_dir}:{env.get('PATH', '')}"
        return env

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.repository = prepare_repository(self.settings, self.workdir)
        backends = _prepare_backends(self.dist, self.workdir)
        cmd = self.command(backends)
        log.info("starting %s (from %s)", " ".join(cmd), self.dist.origin)
        out: Any = None
        if self.settings.log_file is not None:
            self._log = self.settings.log_file.open("a")
            out = self._log
        self.proc = subprocess.Popen(
            cmd,
            env=self.environment(),
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
            # `cosyedge triton` killed by SIGKILL must not leave the server holding its ports.
            preexec_fn=die_with_parent() if self.settings.die_with_parent else None,
        )
        try:
            self._wait_live()
            if self.settings.load_model:
                for model in (self.settings.model, *self.settings.extra_models):
                    self.load(model)
        except BaseException:
            self.stop()
            raise

    def _log_tail(self) -> str:
        if self.settings.log_file is None or not self.settings.log_file.exists():
            return ""
        text = self.settings.log_file.read_text(errors="replace")
        return "\n" + "\n".join(text.splitlines()[-25:])

    def _wait_live(self) -> None:
        deadline = time.monotonic() + self.settings.ready_timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise TritonError(
                    f"tritonserver exited with status {self.proc.returncode} while starting" + self._log_tail()
                )
            try:
                with urllib.request.urlopen(f"{self.http_url}/v2/health/live", timeout=1.0) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise TritonError(f"tritonserver not live after {self.settings.ready_timeout_s:.0f} s" + self._log_tail())

    def client(self) -> Any:
        try:
            import tritonclient.grpc as grpcclient
        except ImportError:
            raise MissingExtraError("tritonclient[grpc]", "cloud", "loading models into Triton") from None
        return grpcclient.InferenceServerClient(self.grpc_url)

    def load(self, model: str) -> list[str]:
        """Load (or reload, picking up new version directories) a model through
        the model control API; returns the versions now ready."""
        client = self.client()
        try:
            try:
                client.load_model(model, client_timeout=self.settings.ready_timeout_s)
            except Exception as exc:
                raise TritonError(f"loading model {model!r} failed: {exc}" + self._log_tail()) from None
            return self.ready_versions(model, client)
        finally:
            client.close()

    def unload(self, model: str) -> None:
        client = self.client()
        try:
            client.unload_model(model, client_timeout=self.settings.ready_timeout_s)
        finally:
            client.close()

    def ready_versions(self, model: str, client: Any = None) -> list[str]:
        own = client is None
        client = client or self.client()
        try:
            index = client.get_model_repository_index(as_json=True).get("models", [])
            return sorted(
                (m.get("version", "") for m in index if m.get("name") == model and m.get("state") == "READY"),
                key=lambda v: int(v) if v.isdigit() else 0,
            )
        finally:
            if own:
                client.close()

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout_s: float | None = None) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # tritonserver unloads its models and exits
            try:
                self.proc.wait(timeout=timeout_s or self.settings.exit_timeout_s + 20)
            except subprocess.TimeoutExpired:
                log.warning("tritonserver did not stop in time; killing it")
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def _version_bundles(values: list[str] | None) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for item in values or []:
        version, sep, path = item.partition("=")
        if not sep or not version.isdigit() or not path:
            raise TritonError(f"--version-bundle takes VERSION=DIR, e.g. 2=/srv/bundles/new, got {item!r}")
        out[version] = Path(path)
    return out


def triton_command(args: argparse.Namespace) -> int:
    settings = LaunchSettings(
        bundle=Path(args.bundle),
        version_bundles=_version_bundles(getattr(args, "version_bundle", None)),
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        metrics_port=getattr(args, "metrics_port", 8002),
        address=getattr(args, "address", None) or "127.0.0.1",
        workdir=Path(args.workdir) if getattr(args, "workdir", None) else None,
        batching=DynamicBatching(getattr(args, "max_batch_size", None), getattr(args, "queue_delay_us", None),
                                 "KIND_GPU" if getattr(args, "gpu", False) else None),
        die_with_parent=True,
    )
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("%s: stopping tritonserver", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = TritonServer(settings)
    server.start()
    try:
        versions = server.ready_versions(settings.model)
        print(
            f"Triton ready: gRPC {server.grpc_url}, HTTP {server.http_url}, metrics {server.metrics_url}; "
            f"model {settings.model} versions {', '.join(versions) or 'none'}",
            flush=True,
        )
        while not stop.wait(1.0):
            code = server.poll()
            if code is not None:
                log.error("tritonserver exited with status %s", code)
                return 1
        return 0
    finally:
        server.stop()
