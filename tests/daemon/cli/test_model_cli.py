"""`cosyedge model list` / `remove`, the bundles folder (install, recovery of
an interrupted replace) and `doctor`'s installed-bundles line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cosyedge_daemon.cli.bundles import (
    bundle_name,
    bundles_dir,
    install_bundle,
    list_bundles,
    recover,
    remove_bundle,
)
from cosyedge_daemon.cli.main import main
from cosyedge_models.errors import CosyEdgeError

from tests.support.broker import free_port


def _copy(tiny_bundle: Path, dest: Path) -> Path:
    shutil.copytree(tiny_bundle, dest)
    return dest


def test_bundles_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    system = tmp_path / "var-lib-cosyedge-bundles"
    assert bundles_dir(system=system) == tmp_path / "data" / "cosyedge" / "bundles"  # no service folder here
    system.mkdir()
    assert bundles_dir(system=system) == system  # the service's folder, writable by this user
    monkeypatch.setenv("STATE_DIRECTORY", f"{tmp_path}/state:{tmp_path}/other")
    assert bundles_dir() == tmp_path / "state" / "bundles"
    assert bundles_dir(str(tmp_path / "mine")) == tmp_path / "mine"


def test_bundle_names() -> None:
    assert bundle_name("CosyVoice2-0.5B", "int8") == "cosyvoice2-0.5b-int8"
    assert bundle_name("FunAudioLLM/CosyVoice2-0.5B", "fp16") == "cosyvoice2-0.5b-fp16"
    with pytest.raises(CosyEdgeError, match="is not a bundle name"):
        remove_bundle(Path("/nonexistent"), "../etc")


def test_install_replaces_only_when_complete_and_recovers(tiny_bundle: Path, tmp_path: Path) -> None:
    root = tmp_path / "bundles"
    root.mkdir()
    first = install_bundle(root, "cv-fp32", _copy(tiny_bundle, root / ".build-1"), {"commit": "a" * 40})
    assert json.loads((first / "pull.json").read_text())["commit"] == "a" * 40
    second = install_bundle(root, "cv-fp32", _copy(tiny_bundle, root / ".build-2"), {"commit": "b" * 40})
    assert second == first and json.loads((first / "pull.json").read_text())["commit"] == "b" * 40
    assert sorted(p.name for p in root.iterdir()) == ["cv-fp32"]
    # a run stopped between its two renames: the old bundle is set aside, the new one absent
    (root / "cv-fp32").rename(root / ".cv-fp32.replaced")
    recover(root)
    assert (root / "cv-fp32" / "manifest.json").is_file() and not (root / ".cv-fp32.replaced").exists()


def test_model_list_and_remove(tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "bundles"
    assert main(["model", "list", "--bundles-dir", str(root)]) == 0
    assert "no bundles in" in capsys.readouterr().out
    root.mkdir()
    install_bundle(root, "tiny-fp32", _copy(tiny_bundle, root / ".b"),
                   {"source": "huggingface", "repo": "x/tiny", "commit": "c" * 40})
    (root / "broken").mkdir()
    assert main(["model", "list", "--bundles-dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert "tiny-fp32: fp32" in out and "from huggingface x/tiny@cccccccccccc" in out
    assert "broken: no readable manifest.json" in out
    # the configured bundle is not removed without --force
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[tts]\nbundles_dir = "{root}"\nbundle = "{root / "tiny-fp32"}"\n')
    assert main(["model", "remove", "tiny-fp32", "--config", str(cfg)]) == 2
    assert "is the configured [tts] bundle" in capsys.readouterr().err
    assert main(["model", "remove", "nothere", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "no bundle 'nothere'" in err and "installed: broken, tiny-fp32" in err
    assert main(["model", "remove", "tiny-fp32", "--config", str(cfg), "--force"]) == 0
    assert [b.name for b in list_bundles(root)] == ["broken"]
    assert sorted(p.name for p in root.iterdir()) == ["broken"]


def test_doctor_lists_installed_bundles(tiny_bundle: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "bundles"
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'device_id = "d"\n[mqtt]\nbroker = "mqtt://127.0.0.1:{free_port()}"\nlocal_broker = "off"\n'
                   f'[tts]\nengine = "espeak-ng"\nbundles_dir = "{root}"\n[audio]\ndevice = "none"\n')
    main(["doctor", "--config", str(cfg)])
    out = capsys.readouterr().out
    assert f"[warn] installed bundles: none in {root}" in out and "fix: cosyedge model pull" in out
    root.mkdir()
    install_bundle(root, "tiny-fp32", _copy(tiny_bundle, root / ".b"), {})
    main(["doctor", "--config", str(cfg)])
    line = next(x for x in capsys.readouterr().out.splitlines() if "installed bundles" in x)
    assert line.startswith("[ok  ]") and "tiny-fp32: fp32" in line


def test_set_keys_keeps_the_file_and_loads(tmp_path: Path) -> None:
    from cosyedge_daemon.cli.config_edit import set_keys, write_config

    text = '# top\ndevice_id = "d"\n[tts]\n# mine\nbackend = "ort"\nengine = "cosyvoice"\n[audio]\ndevice = "none"\n'
    new = set_keys(text, "tts", {"bundle": "/b/x y", "backend": "ort-cuda"})
    assert new == ('# top\ndevice_id = "d"\n[tts]\nbundle = "/b/x y"\n# mine\nbackend = "ort-cuda"\n'
                   'engine = "cosyvoice"\n[audio]\ndevice = "none"\n')
    assert set_keys("", "tts", {"bundle": "/b"}) == '[tts]\nbundle = "/b"\n'
    assert set_keys('[mqtt]\nbroker = "mqtt://h"\n', "tts", {"bundle": "/b"}).endswith('\n\n[tts]\nbundle = "/b"\n')
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    with pytest.raises(CosyEdgeError, match="backend"):
        write_config(cfg, "tts", {"backend": "cuda"})  # the schema refuses it: the file stays as it was
    assert cfg.read_text() == text and [p.name for p in tmp_path.iterdir()] == ["c.toml"]
