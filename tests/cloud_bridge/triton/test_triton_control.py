"""Explicit model control: versions come and go through Triton's model
control API while the bridge keeps serving (a rollout: add version 3, the
version policy serves the two newest, pins follow)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from cosyedge_cloud.triton.launcher import LaunchSettings, TritonError
from cosyedge_cloud.wire.protocol import CloudRequest
from cosyedge_models.errors import BundleError

from tests.cloud_bridge.conftest import SINE_MODEL
from tests.cloud_bridge.device import Device
from tests.support.fake_synthesizer import dominant_frequency, write_sine_bundle


def test_unload_load_and_a_new_version(broker, make_bridge, triton, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    assert triton.ready_versions(SINE_MODEL) == ["1", "2"]
    make_bridge(triton={"retries": 1, "retry_backoff_ms": 50})
    device = Device(broker.url, "kitchen")
    assert triton.repository is not None
    v3 = triton.repository / SINE_MODEL / "3"
    try:
        triton.unload(SINE_MODEL)
        assert triton.ready_versions(SINE_MODEL) == []
        gone = device.ask(CloudRequest(id="gone", text="hi"))
        assert gone.error is not None and gone.error.code == "unavailable", gone.error  # retried, given up
        pinned = device.ask(CloudRequest(id="pinned", text="hi", model_version="1"))
        assert pinned.error is not None and pinned.error.code == "unknown_version"

        shutil.copytree(
            triton.repository / SINE_MODEL / "2",
            v3,
            symlinks=False,
            ignore=shutil.ignore_patterns("bundle"),
        )
        (v3 / "bundle").symlink_to(write_sine_bundle(tmp_path / "v3", 880.0))
        assert triton.load(SINE_MODEL) == ["2", "3"]  # latest { num_versions: 2 }
        new = device.ask(CloudRequest(id="new", text="hi", model_version="3"))
        old = device.ask(CloudRequest(id="old", text="hi", model_version="1"))
        assert new.done is not None and new.done.summary["model_version"] == "3"
        assert abs(dominant_frequency(new.pcm(), 24000) - 880.0) < 15
        assert old.error is not None and old.error.code == "unknown_version"
    finally:
        device.close()
        shutil.rmtree(v3, ignore_errors=True)
        triton.load(SINE_MODEL)
    assert triton.ready_versions(SINE_MODEL) == ["1", "2"]


def test_launcher_refuses_a_missing_bundle(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="not a directory"):
        LaunchSettings(bundle=tmp_path / "nope")
    with pytest.raises(TritonError, match="TCP port"):
        LaunchSettings(bundle=tmp_path, grpc_port=0)


def test_only_the_named_versions_are_served(tmp_path: Path) -> None:
    """Each served version loads its own engine (at full size on a GPU, its own graphs and lanes): the
    load test serves the latest version alone. The served copy keeps only the named version folders;
    a version the model lacks, or a name that is not a number, is refused with what there is."""
    from cosyedge_cloud.triton.launcher import REPOSITORY, model_versions, prepare_repository

    shipped = model_versions(REPOSITORY / "cosyvoice2")
    assert shipped == ["1", "2"]
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    repo = prepare_repository(LaunchSettings(bundle=bundle, versions=(shipped[-1],)), tmp_path / "one")
    assert model_versions(repo / "cosyvoice2") == ["2"]
    assert (repo / "cosyvoice2" / "2" / "bundle").resolve() == bundle.resolve()
    assert model_versions(REPOSITORY / "cosyvoice2") == ["1", "2"]  # the checkout is untouched
    every = prepare_repository(LaunchSettings(bundle=bundle), tmp_path / "every")
    assert model_versions(every / "cosyvoice2") == ["1", "2"]
    with pytest.raises(TritonError, match="has no version 7; it has 1, 2"):
        prepare_repository(LaunchSettings(bundle=bundle, versions=("7",)), tmp_path / "none")
    with pytest.raises(TritonError, match="versions are version numbers"):
        LaunchSettings(bundle=bundle, versions=("latest",))
