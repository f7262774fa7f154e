"""`cosyedge doctor`: checks what the daemon needs on this machine and says
how to fix what is missing. Exit status 1 when a required check fails
(what is required depends on the config: TensorRT only for backend trt).

GPU, TensorRT and engine state come from cosyedge_models.backends.report (the CUDA
driver probe of cosyedge_models.backends.gpu_probe, which never imports tensorrt
without a GPU, and the engines' recorded identity against this device)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosyedge_cloud.wire.broker import LOCAL_HOSTS, find_mosquitto, port_open
from cosyedge_daemon.cli.bundles import bundles_dir, list_bundles
from cosyedge_daemon.cli.default_bundle import tiny_bundle_dir
from cosyedge_daemon.settings.loader import load_settings, parse_broker_url
from cosyedge_daemon.settings.schema import Settings
from cosyedge_models.backends.gpu_probe import probe_gpu, probe_tensorrt
from cosyedge_models.backends.report import engine_report, tensorrt_status
from cosyedge_models.bundle.memory_budget import MIB


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True

    def line(self) -> str:
        mark = "ok  " if self.ok else ("FAIL" if self.required else "warn")
        return f"[{mark}] {self.name}: {self.detail}" + (
            "" if self.ok or not self.fix else f"\n       fix: {self.fix}"
        )


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_name() -> str | None:
    if shutil.which("nvidia-smi"):
        out = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
        if out:
            return out.splitlines()[0]
    tegra = Path("/etc/nv_tegra_release")
    if tegra.exists():
        return "Jetson (" + tegra.read_text(errors="replace").splitlines()[0].strip("# ") + ")"
    if shutil.which("tegrastats"):
        return "Jetson (tegrastats present)"
    proc = Path("/proc/driver/nvidia/version")
    if proc.exists():
        return proc.read_text(errors="replace").splitlines()[0]
    return None


def check_gpu(needed: bool) -> Check:
    # The CUDA driver decides, not nvidia-smi: a board can list a GPU it cannot run on.
    probe = probe_gpu()
    if probe.available:
        v = probe.driver_version
        driver = f", CUDA driver {v // 1000}.{v % 1000 // 10}" if v else ""
        return Check("GPU", True, probe.reason + driver)
    seen = gpu_name()
    return Check(
        "GPU",
        False,
        f"{seen} is present but CUDA cannot use it: {probe.reason}" if seen else f"no usable GPU: {probe.reason}",
        'install the NVIDIA driver / JetPack, or use [tts] backend = "ort" (CPU)',
        required=needed,
    )


def tensorrt_version() -> str | None:
    """The real TensorRT's version (not tensorrt-stubs'); None without a GPU,
    where importing tensorrt is not attempted (it can crash there)."""
    return probe_tensorrt().version


def check_tensorrt(needed: bool) -> list[Check]:
    status = tensorrt_status()
    trt = status["tensorrt"]
    if not trt["available"]:
        return [Check(
            "TensorRT",
            False,
            trt["detail"],
            "on a Jetson: apt install python3-libnvinfer (JetPack) and create the venv with "
            "--system-site-packages",
            required=needed,
        )]
    checks = [Check("TensorRT", True, trt["detail"])]
    # The trt backend also needs pycuda (its CUDA memory and streams).
    pycuda_fix = next((f for f in status["fix"] if "pycuda" in f), "pip install pycuda")
    checks.append(Check("pycuda", status["pycuda"]["available"],
                        "installed" if status["pycuda"]["available"] else "not installed",
                        pycuda_fix.removeprefix("install pycuda on the board: "), required=needed))
    return checks


def check_engines(path: Path, trt_needed: bool, manifest: dict[str, Any]) -> list[Check]:
    """Built TensorRT engines: present, built for this GPU and TensorRT; and the
    bundle's Jetson memory budget (information only)."""
    report = engine_report(path)
    if "error" in report:
        return [Check("TensorRT engines", False, report["error"], "rebuild the bundle", required=trt_needed)]
    state = report["engines"]
    checks = []
    precision = str(manifest.get("precision", "fp32"))
    if not manifest.get("engines"):  # (state["built"] is the build's timestamp once built)
        checks.append(Check("TensorRT engines", False, "the bundle has no TensorRT engines",
                            state.get("fix") or f"cosyedge build engines --bundle {path}", required=trt_needed))
    else:
        built = (f"built for {state.get('gpu') or '?'} / TensorRT {state.get('tensorrt') or '?'} "
                 f"({state.get('precision') or '?'})")
        notes = "; ".join([*state.get("problems", []), *state.get("warnings", [])])
        compatible = state.get("compatible")
        verdict = {True: "match this device", False: "do not match this device", None: "not checked"}[compatible]
        checks.append(Check("TensorRT engines", compatible is True,
                            f"{built}: {verdict}" + (f" ({notes})" if notes else ""),
                            state.get("fix") or f"cosyedge build engines --bundle {path}", required=trt_needed))
    # The engines' precision when built, else the one the bundle loads by default.
    budget = report.get("budget", {}).get(state.get("precision") or precision)
    if budget is not None:
        fits = [b for b in budget["boards"] if b["fits"]]
        detail = (f"{budget['precision']} needs {budget['boards'][0]['needed_bytes'] / MIB:.0f} MiB; "
                  f"fits: {', '.join(b['board'] for b in fits) or 'no Jetson module'}")
        checks.append(Check("Jetson memory budget", bool(fits), detail,
                            "quantize (cosyedge build quantize --precision int8) or pick a larger module",
                            required=False))
    return checks


def check_bundle(settings: Settings) -> list[Check]:
    if settings.tts.engine == "espeak-ng":
        return [Check("bundle", True, 'not used ([tts] engine = "espeak-ng")')]
    path = Path(settings.tts.bundle) if settings.tts.bundle else tiny_bundle_dir()
    manifest_path = path / "manifest.json"
    if not manifest_path.exists():
        if not settings.tts.bundle:
            ok = importlib.util.find_spec("torch") is not None
            return [
                Check(
                    "bundle",
                    ok,
                    f"the tiny bundle is not built yet ({path}); `cosyedge run` builds it",
                    "pip install 'cosyedge[build]' (or pass --bundle DIR)",
                )
            ]
        return [
            Check(
                "bundle",
                False,
                f"{path} has no manifest.json",
                "cosyedge model pull --set-default (or cosyedge build export --model-dir CKPT --out DIR: "
                "docs/models.md)",
            )
        ]
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        return [Check("bundle", False, f"{manifest_path} is unreadable: {exc}", "rebuild the bundle")]
    checks = [
        Check(
            "bundle",
            True,
            f"{path} ({manifest.get('precision', '?')}, {manifest.get('sample_rate', '?')} Hz)",
        )
    ]
    return checks + check_engines(path, settings.tts.backend == "trt", manifest)


def check_installed_bundles(settings: Settings) -> Check:
    """What `cosyedge model pull` installed (information: the daemon uses [tts] bundle)."""
    root = bundles_dir(settings.tts.bundles_dir)
    bundles = list_bundles(root)
    if not bundles:
        return Check("installed bundles", False, f"none in {root}",
                     "cosyedge model pull (downloads CosyVoice2-0.5B and builds the bundle for this machine)",
                     required=False)
    broken = [b for b in bundles if b.problem]
    return Check("installed bundles", not broken, "; ".join(b.line() for b in bundles),
                 "cosyedge model remove NAME, then pull it again" if broken else "", required=False)


def check_runtime() -> Check:
    missing = [
        m
        for m in ("onnxruntime", "tokenizers", "paho.mqtt", "soxr", "prometheus_client")
        if importlib.util.find_spec(m.split(".")[0]) is None
    ]
    if missing:
        return Check("Python packages", False, f"missing: {', '.join(missing)}", "pip install cosyedge")
    return Check("Python packages", True, "onnxruntime, tokenizers, paho-mqtt, soxr, prometheus-client")


def check_audio(settings: Settings) -> Check:
    if settings.audio_device == "none":
        return Check("audio devices", True, "not used (--audio none)", required=False)
    try:
        import sounddevice

        devices = sounddevice.query_devices()
    except (OSError, ImportError) as exc:
        return Check(
            "audio devices",
            False,
            f"PortAudio unavailable: {exc}",
            "apt-get install libportaudio2",
            required=False,
        )
    names = [f"{d['name']} (in {d['max_input_channels']}, out {d['max_output_channels']})" for d in devices]
    if not names:
        return Check(
            "audio devices",
            False,
            "no sound card found; the daemon runs with output 'publish' only",
            "connect a sound card; check `aplay -l`, and that the user is in the audio group",
            required=settings.audio_device not in ("default", "none"),
        )
    return Check("audio devices", True, "; ".join(names))


def check_broker(settings: Settings) -> Check:
    addr = parse_broker_url(settings.mqtt.broker)
    if port_open(addr.host, addr.port, timeout_s=2.0):
        return Check("MQTT broker", True, f"{addr.host}:{addr.port} reachable")
    if addr.host in LOCAL_HOSTS and settings.mqtt.local_broker == "auto" and find_mosquitto():
        return Check(
            "MQTT broker", True, f"nothing on {addr.host}:{addr.port}; `cosyedge run` starts mosquitto"
        )
    return Check(
        "MQTT broker",
        False,
        f"{addr.host}:{addr.port} is not reachable",
        "apt-get install mosquitto (or pass --broker URL of a running broker)",
    )


def check_espeak(settings: Settings) -> Check:
    needed = settings.tts.engine == "espeak-ng"
    path = shutil.which(settings.fallback.binary)
    if path:
        return Check(
            "espeak-ng",
            True,
            f"{path} (fallback voice {'on' if settings.fallback.enabled else 'off'})",
            required=needed,
        )
    return Check(
        "espeak-ng",
        False,
        "not installed: no fallback voice when the engine fails",
        "apt-get install espeak-ng",
        required=needed,
    )


def check_wyoming(settings: Settings) -> list[Check]:
    """Each configured Wyoming listener: answering describe (the daemon runs),
    free (`cosyedge run` will listen there), or taken by something else."""
    import asyncio

    from cosyedge_daemon.settings.wyoming import parse_tcp_uri
    from cosyedge_daemon.wyoming.client import describe

    checks = []
    for name, uri in (("Wyoming TTS", settings.wyoming.uri), ("Wyoming satellite", settings.wyoming_satellite.uri)):
        if not uri:
            checks.append(Check(name, True, "off ([wyoming] uri / [wyoming.satellite] uri, or --wyoming-uri)",
                                required=False))
            continue
        host, port = parse_tcp_uri(uri, name)
        probe_host = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
        if not port_open(probe_host, port, timeout_s=2.0):
            checks.append(Check(name, True, f"{uri}: free; `cosyedge run` listens there"))
            continue
        try:
            info = asyncio.run(describe(f"tcp://{probe_host}:{port}"))
        except Exception as exc:
            checks.append(Check(name, False, f"{uri}: something listens there but does not answer describe "
                                f"({exc})", "stop what holds the port or pick another one"))
            continue
        what = (f"TTS {info.tts[0].name}, {len(info.tts[0].voices)} voice(s)" if info.tts
                else f"satellite {info.satellite.name}" if info.satellite else "no TTS program")
        checks.append(Check(name, True, f"{uri}: answering ({what})"))
    return checks


def check_http(settings: Settings) -> Check:
    """The HTTP speech API: off, free (`cosyedge run` listens there), answering
    GET /v1/models (the daemon runs), or taken by something else."""
    import json
    import urllib.request

    from cosyedge_daemon.settings.http import parse_listen

    name, listen = "HTTP speech API", settings.http.listen
    if not listen:
        return Check(name, True, "off ([http] listen, or --http-listen)", required=False)
    host, port = parse_listen(listen, "[http] listen")
    probe_host = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
    if not port_open(probe_host, port, timeout_s=2.0):
        return Check(name, True, f"{listen}: free; `cosyedge run` listens there")
    url_host = f"[{probe_host}]" if ":" in probe_host else probe_host
    try:
        with urllib.request.urlopen(f"http://{url_host}:{port}/v1/models", timeout=5) as reply:
            models = [m["id"] for m in json.load(reply)["data"]]
    except Exception as exc:
        return Check(name, False, f"{listen}: something listens there but does not answer GET /v1/models ({exc})",
                     "stop what holds the port or pick another one")
    return Check(name, True, f"{listen}: answering (models {', '.join(models)}; "
                 f"OpenAI API base URL http://<this host>:{port}/v1)")


def run_checks(settings: Settings) -> list[Check]:
    trt = settings.tts.backend == "trt" and settings.tts.engine == "cosyvoice"
    return [
        check_gpu(trt),
        *check_tensorrt(trt),
        *check_bundle(settings),
        check_installed_bundles(settings),
        check_runtime(),
        check_audio(settings),
        check_broker(settings),
        check_espeak(settings),
        *check_wyoming(settings),
        check_http(settings),
    ]


def doctor_command(args: argparse.Namespace) -> int:
    settings = load_settings(getattr(args, "config", None), args)
    checks = run_checks(settings)
    for c in checks:
        print(c.line())
    failed = [c.name for c in checks if c.required and not c.ok]
    print("\nall required checks passed" if not failed else f"\nmissing: {', '.join(failed)}")
    return 1 if failed else 0
