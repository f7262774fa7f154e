"""`cosyedge say`, `cosyedge doctor`, the private broker and the default
bundle location."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import soundfile
from cosyedge_cloud.wire.broker import ensure_broker, port_open
from cosyedge_daemon.cli.default_bundle import cache_dir, ensure_tiny_bundle, tiny_bundle_dir
from cosyedge_daemon.cli.doctor import doctor_command, tensorrt_version
from cosyedge_daemon.cli.say import say_command
from cosyedge_daemon.settings.loader import parse_broker_url

from tests.daemon.conftest import DaemonFactory
from tests.support.broker import free_port, mosquitto_binary
from tests.support.components import require_binary


def _say_args(broker: str, device: str, **kw: object) -> argparse.Namespace:
    base = {
        "text": "Hello from the command line. Second sentence.",
        "broker": broker,
        "device_id": device,
        "out": None,
        "voice": None,
        "route": "auto",
        "mode": None,
        "instruct_text": None,
        "timeout_s": 20.0,
    }
    base.update(kw)
    return argparse.Namespace(**base)


def test_say_writes_wav_and_prints_latency(
    daemons: DaemonFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    svc = daemons.start()
    out = tmp_path / "out.wav"
    assert say_command(_say_args(daemons.broker.url, svc.settings.device_id, out=str(out))) == 0
    pcm, rate = soundfile.read(out)
    assert rate == 24000 and pcm.size > 24000
    printed = capsys.readouterr().out
    assert "time to first audio" in printed and "RTF" in printed and "route local" in printed


def test_say_plays_on_the_daemon_and_reports_errors(
    daemons: DaemonFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.support.memory_sink import MemorySink

    sink = MemorySink(speed=8.0)
    svc = daemons.start(sink=sink)
    assert say_command(_say_args(daemons.broker.url, svc.settings.device_id)) == 0
    assert sink.played_seconds() > 1.0
    assert say_command(_say_args(daemons.broker.url, svc.settings.device_id, voice="nope")) == 1
    assert "error unknown_voice" in capsys.readouterr().err


def _doctor_args(config: Path) -> argparse.Namespace:
    return argparse.Namespace(config=str(config), bundle=None, broker=None)


def test_doctor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'device_id = "d"\n[mqtt]\nbroker = "mqtt://127.0.0.1:{port}"\nlocal_broker = "off"\n'
        '[tts]\nengine = "espeak-ng"\n[audio]\ndevice = "none"\n'
    )
    assert doctor_command(_doctor_args(cfg)) == 1  # no broker there
    out = capsys.readouterr().out
    assert "[FAIL] MQTT broker" in out and "fix: apt-get install mosquitto" in out
    assert "[ok  ] espeak-ng" in out
    cfg.write_text(cfg.read_text().replace('local_broker = "off"', 'local_broker = "auto"'))
    expected = 0 if mosquitto_binary() else 1
    assert doctor_command(_doctor_args(cfg)) == expected
    cfg.write_text(
        cfg.read_text().replace(
            'engine = "espeak-ng"', f'engine = "cosyvoice"\nbackend = "trt"\nbundle = "{tmp_path}/nobundle"'
        )
    )
    assert doctor_command(_doctor_args(cfg)) == 1
    out = capsys.readouterr().out
    if tensorrt_version() is None:
        assert "[FAIL] TensorRT" in out and "python3-libnvinfer" in out
    assert "[FAIL] bundle" in out and "has no manifest.json" in out


def test_doctor_reports_engine_state_and_budget(tiny_bundle: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Engines recorded in the manifest are checked against this device (without
    a GPU: not checkable, with the reason) and for their plan files; the Jetson
    budget is shown."""
    bundle = tmp_path / "b"
    bundle.mkdir()
    manifest = json.loads((tiny_bundle / "manifest.json").read_text())
    manifest["engines"] = {"gpu": "Orin (nvgpu)", "tensorrt": "10.3.0", "compute_capability": "8.7",
                           "precision": "fp16", "built": "2026-11-30T10:00:00Z",
                           "stages": {"llm_decode": {"file": "llm_decode.fp16.plan"}}}
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'device_id = "d"\n[mqtt]\nbroker = "mqtt://127.0.0.1:{free_port()}"\nlocal_broker = "off"\n'
                   f'[tts]\nengine = "cosyvoice"\nbackend = "ort"\nbundle = "{bundle}"\n[audio]\ndevice = "none"\n')
    doctor_command(_doctor_args(cfg))
    out = capsys.readouterr().out
    engines = next(line for line in out.splitlines() if "TensorRT engines" in line)
    assert "built for Orin (nvgpu) / TensorRT 10.3.0 (fp16)" in engines
    assert "[warn] TensorRT engines" in engines  # backend ort: not required
    assert "missing plan files for llm_decode" in engines
    if tensorrt_version() is None:
        assert "cannot check here" in engines
    assert "Jetson memory budget: fp16 needs" in out and "orin-nano-8gb" in out


def test_tensorrt_stubs_are_not_tensorrt() -> None:
    version = tensorrt_version()
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        assert version is None
        return
    import tensorrt as trt

    assert (version is not None) == hasattr(trt, "Builder")


def test_private_broker_started_only_when_needed() -> None:
    require_binary("mosquitto", "apt-get install mosquitto")
    port = free_port()
    broker = ensure_broker(parse_broker_url(f"mqtt://localhost:{port}"), "auto")
    assert broker is not None
    try:
        assert port_open("127.0.0.1", port)
        assert ensure_broker(parse_broker_url(f"mqtt://localhost:{port}"), "auto") is None  # one is running
    finally:
        broker.stop()
    assert not port_open("127.0.0.1", port)
    assert ensure_broker(parse_broker_url(f"mqtt://localhost:{port}"), "off") is None
    assert ensure_broker(parse_broker_url("mqtt://broker.example:1883"), "auto") is None


def test_default_bundle_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tiny_bundle_dir() == tmp_path / "xdg" / "cosyedge" / "tiny-bundle"
    monkeypatch.setenv("CACHE_DIRECTORY", f"{tmp_path}/sd:{tmp_path}/other")
    assert cache_dir() == tmp_path / "sd"
    built = tmp_path / "sd" / "tiny-bundle"
    built.mkdir(parents=True)
    from cosyedge_daemon.cli.default_bundle import _current
    from cosyedge_models.bundle.loader import FORMAT_VERSION

    (built / "manifest.json").write_text(json.dumps({"format": "cosyedge-bundle", "format_version": FORMAT_VERSION}))
    assert ensure_tiny_bundle() == built  # present: not rebuilt
    # one left by an older cosyedge (another bundle format) is rebuilt, not loaded and refused
    (built / "manifest.json").write_text(json.dumps({"format": "cosyedge-bundle", "format_version": 1}))
    assert not _current(built)
    (built / "manifest.json").write_text("{not json")
    assert not _current(built)


def test_run_without_bundle_or_build_extra_says_how_to_get_one(tmp_path: Path) -> None:
    """A board without the build extra (no torch): `cosyedge run` with no bundle
    configured prints one line naming both ways to get a bundle and exits 2,
    before it starts a broker or loads anything."""
    import os
    import subprocess
    import sys

    blocker = tmp_path / "no-torch" / "torch"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    path = os.pathsep.join(p for p in (str(blocker.parent), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("CACHE_DIRECTORY", None)
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from cosyedge_daemon.cli.main import main; sys.exit(main())", "run",
         "--broker", f"mqtt://127.0.0.1:{free_port()}", "--audio", "none"],
        env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("cosyedge run:")]
    assert len(lines) == 1, proc.stderr
    assert "--bundle" in lines[0] and "pip install 'cosyedge[build]'" in lines[0]
    assert not (tmp_path / "cache" / "cosyedge" / "tiny-bundle").exists()


@pytest.mark.parametrize(("value", "message"), [("0.01", "0.01 ms is outside 0.05 .. 100 ms"),
                                                ("fast", "'fast' is not a number of milliseconds")])
def test_bench_refuses_a_switch_interval_outside_the_settings_range(
        value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from cosyedge_daemon.cli.main import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "--bundle", "b", "--python-switch-interval-ms", value])
    assert exc.value.code == 2
    assert f"--python-switch-interval-ms: {message}" in capsys.readouterr().err
