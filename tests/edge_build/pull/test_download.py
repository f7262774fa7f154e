"""`model pull`'s download through huggingface_hub against the fake hub:
only the needed files, checked against the hub's hashes, resumed after a
dropped connection without fetching finished files again, corrupt files
refused, and a clear error without network."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
from cosyedge_build.pull.download import VERIFIED, HubUnreachableError, download_checkpoint
from cosyedge_build.pull.hub import ChecksumError, RepoFile, needed_files, resolve_repo, verify
from cosyedge_build.reference.modules import REQUIRED_FILES
from cosyedge_models.errors import CosyEdgeError

from tests.edge_build.pull.conftest import EXTRA, REPO
from tests.support.broker import free_port
from tests.support.fake_hub import FakeHub


def _source_files(tiny_model_dir: Path) -> list[str]:
    return sorted(p.relative_to(tiny_model_dir).as_posix() for p in tiny_model_dir.rglob("*")
                  if p.is_file() and not p.name.startswith("."))


def test_needed_files_and_names() -> None:
    files = [RepoFile(f, 1) for f in (*REQUIRED_FILES, "spk2info.pt", "CosyVoice-BlankEN/vocab.json", "x.zip")]
    assert [f.path for f in needed_files(files, "r")] == [f.path for f in files[:-1]]
    with pytest.raises(CosyEdgeError, match="is not a CosyVoice 2 checkpoint: it has no llm.pt"):
        needed_files([f for f in files if f.path != "llm.pt"], "o/r")
    assert resolve_repo("CosyVoice2-0.5B", "huggingface") == ("FunAudioLLM/CosyVoice2-0.5B", "CosyVoice2-0.5B")
    assert resolve_repo("cosyvoice2-0.5b", "modelscope") == ("iic/CosyVoice2-0.5B", "CosyVoice2-0.5B")
    assert resolve_repo("me/My-Voice", "huggingface") == ("me/My-Voice", "My-Voice")
    with pytest.raises(CosyEdgeError, match="unknown model 'nope'"):
        resolve_repo("nope", "huggingface")


def test_verify_by_git_blob_id_and_sha256(tmp_path: Path) -> None:
    f = tmp_path / "a.txt"
    f.write_bytes(b"hello\n")
    blob = "ce013625030ba8dba906f756967f9e9ca394464a"  # `printf 'hello\n' | git hash-object --stdin`
    assert verify(f, RepoFile("a.txt", 6, blob_id=blob), "hub") == blob
    sha = "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03"  # sha256sum
    assert verify(f, RepoFile("a.txt", 6, sha256=sha), "hub") == sha
    with pytest.raises(ChecksumError, match="6 bytes downloaded, hub says 7"):
        verify(f, RepoFile("a.txt", 7, sha256=sha), "hub")
    with pytest.raises(ChecksumError, match="sha256 .* does not match"):
        verify(f, RepoFile("a.txt", 6, sha256="0" * 64), "hub")


def test_download_only_needed_files_checked(fake_hub: FakeHub, tiny_model_dir: Path, tmp_path: Path) -> None:
    ckpt = download_checkpoint(REPO, "main", tmp_path / "ckpt", endpoint=fake_hub.url, progress=False)
    assert ckpt.commit == fake_hub.repos[REPO].commit
    got = sorted(f.path for f in ckpt.files)
    assert got == _source_files(tiny_model_dir)
    for name in got:
        assert filecmp.cmp(tiny_model_dir / name, tmp_path / "ckpt" / name, shallow=False), name
    assert not any(e in p for _, p, _ in fake_hub.requests for e in EXTRA)
    verified = json.loads((tmp_path / "ckpt" / VERIFIED).read_text())
    assert verified["llm.pt"] == fake_hub.repos[REPO].sibling("llm.pt")["lfs"]["sha256"]  # type: ignore[index]
    assert verified["cosyvoice2.yaml"] == fake_hub.repos[REPO].blob_id("cosyvoice2.yaml")
    # a second run asks for the file list only
    before = len(fake_hub.requests)
    download_checkpoint(REPO, "main", tmp_path / "ckpt", endpoint=fake_hub.url, progress=False)
    assert [p for _, p, _ in fake_hub.requests[before:]] == [f"/api/models/{REPO}/revision/main?blobs=True"]


def test_dropped_connection_resumes_without_refetching(fake_hub: FakeHub, tiny_model_dir: Path,
                                                       tmp_path: Path) -> None:
    order = [f.path for f in download_checkpoint.__globals__["list_files"](REPO, "main", fake_hub.url)[1]]
    victim = "flow.pt"
    cut = 25_000_000  # huggingface_hub writes 10 MiB chunks: two of them reach the disk
    fake_hub.faults.drop_after[victim] = (cut, 100)  # every attempt of this run ends mid-file
    with pytest.raises(HubUnreachableError, match=f"downloading {victim} of {REPO}.*build export"):
        download_checkpoint(REPO, "main", tmp_path / "ckpt", endpoint=fake_hub.url, progress=False)
    done = order[:order.index(victim)]
    assert done and all(fake_hub.downloads(f) == [""] for f in done)
    fake_hub.faults.drop_after.clear()
    download_checkpoint(REPO, "main", tmp_path / "ckpt", endpoint=fake_hub.url, progress=False)
    assert all(fake_hub.downloads(f) == [""] for f in done), "finished files were fetched again"
    ranges = fake_hub.downloads(victim)
    assert ranges[0] == "" and ranges[-1].startswith("bytes=") and ranges[-1].endswith("-"), ranges
    assert 0 < int(ranges[-1][6:-1]) <= cut, ranges  # resumed where the part on disk ends
    assert filecmp.cmp(tiny_model_dir / victim, tmp_path / "ckpt" / victim, shallow=False)


def test_corrupt_file_refused_then_fetched_again(fake_hub: FakeHub, tiny_model_dir: Path, tmp_path: Path) -> None:
    fake_hub.faults.corrupt = {"hift.pt", "cosyvoice2.yaml"}
    with pytest.raises(ChecksumError, match=r"cosyvoice2.yaml: git blob id [0-9a-f]{40} does not match the hub's"):
        download_checkpoint(REPO, "main", tmp_path / "ckpt", endpoint=fake_hub.url, progress=False)
    assert not (tmp_path / "ckpt" / "cosyvoice2.yaml").exists()
    fake_hub.faults.corrupt = {"hift.pt"}
    with pytest.raises(ChecksumError, match=r"hift.pt: sha256 [0-9a-f]{64} does not match the hub's .*run the pull"):
        download_checkpoint(REPO, "main", tmp_path / "ckpt", endpoint=fake_hub.url, progress=False)
    fake_hub.faults.corrupt = set()
    download_checkpoint(REPO, "main", tmp_path / "ckpt", endpoint=fake_hub.url, progress=False)
    assert filecmp.cmp(tiny_model_dir / "hift.pt", tmp_path / "ckpt" / "hift.pt", shallow=False)


def test_no_network_and_unknown_names(fake_hub: FakeHub, tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(HubUnreachableError) as err:
        download_checkpoint(REPO, "main", tmp_path / "ckpt", endpoint=dead, progress=False)
    message = str(err.value)
    assert dead in message and "HF_ENDPOINT" in message and "cosyedge build export --model-dir" in message
    assert "docs/models.md" in message
    with pytest.raises(CosyEdgeError, match="no model repository tests/nothing"):
        download_checkpoint("tests/nothing", "main", tmp_path / "c2", endpoint=fake_hub.url)
    with pytest.raises(CosyEdgeError, match="has no revision 'v9'"):
        download_checkpoint(REPO, "v9", tmp_path / "c2", endpoint=fake_hub.url)


def test_modelscope_api_same_checks_and_resume(fake_hub: FakeHub, tiny_model_dir: Path, tmp_path: Path) -> None:
    """ModelScope's HTTP API (edge_build/pull/modelscope.py) through the same
    selection, checks and resume as Hugging Face's."""
    victim = "flow.pt"
    fake_hub.faults.drop_after[victim] = (3_000_000, 1)
    with pytest.raises(HubUnreachableError, match=f"downloading {victim} of {REPO}.*MODELSCOPE_DOMAIN"):
        download_checkpoint(REPO, "main", tmp_path / "ckpt", endpoint=fake_hub.url, source="modelscope")
    assert 0 < (tmp_path / "ckpt" / f"{victim}.incomplete").stat().st_size <= 3_000_000
    fake_hub.faults.corrupt = {"hift.pt"}
    with pytest.raises(ChecksumError, match="hift.pt: sha256 .* does not match"):
        download_checkpoint(REPO, "main", tmp_path / "ckpt", endpoint=fake_hub.url, source="modelscope")
    fake_hub.faults.corrupt = set()
    ckpt = download_checkpoint(REPO, "main", tmp_path / "ckpt", endpoint=fake_hub.url, source="modelscope")
    assert sorted(f.path for f in ckpt.files) == _source_files(tiny_model_dir)
    for name in _source_files(tiny_model_dir):
        assert filecmp.cmp(tiny_model_dir / name, tmp_path / "ckpt" / name, shallow=False), name
    ranges = fake_hub.downloads(victim)
    assert ranges[0] == "" and ranges[-1].startswith("bytes=") and len(ranges) == 2, ranges
    assert all(len(fake_hub.downloads(f)) == 1 for f in ("llm.pt", "cosyvoice2.yaml"))  # fetched once
    assert not any(e in p for _, p, _ in fake_hub.requests for e in ("README.md", "asset"))
    with pytest.raises(HubUnreachableError, match="cosyedge build export --model-dir"):
        download_checkpoint(REPO, "main", tmp_path / "c2", endpoint=f"http://127.0.0.1:{free_port()}",
                            source="modelscope")


@pytest.mark.parametrize("source", ["huggingface", "modelscope"])
def test_proxy_from_the_environment(fake_hub: FakeHub, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                    tmp_path: Path, source: str) -> None:
    """HTTP_PROXY is honoured (requests for Hugging Face, urllib for ModelScope):
    the hub's name does not resolve, only the proxy (the fake hub, which also
    answers as a proxy) reaches it."""
    for name in ("NO_PROXY", "no_proxy", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", fake_hub.url)
    ckpt = download_checkpoint(REPO, "main", tmp_path / "ckpt", endpoint="http://hub.invalid", progress=False,
                               source=source)
    assert sorted(f.path for f in ckpt.files) == _source_files(tiny_model_dir)
    assert fake_hub.proxied == len(fake_hub.requests) > len(ckpt.files)
