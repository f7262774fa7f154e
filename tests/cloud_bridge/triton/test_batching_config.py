"""Triton's dynamic batching as settings (cloud_bridge/triton/batching_config.py)
on the shipped config.pbtxt: what Triton reads back is checked by the parser below."""

from __future__ import annotations

import re

import pytest
from cosyedge_cloud.triton.batching_config import BatchingConfigError, DynamicBatching, apply_batching
from cosyedge_cloud.triton.launcher import REPOSITORY

SHIPPED = (REPOSITORY / "cosyvoice2" / "config.pbtxt").read_text()


def _field(config: str, pattern: str) -> str:
    m = re.search(pattern, config, re.M)
    assert m is not None, pattern
    return m.group(1)


def test_batch_size_delay_and_kind_are_rewritten() -> None:
    out = apply_batching(SHIPPED, DynamicBatching(max_batch_size=16, max_queue_delay_us=5000,
                                                  instance_kind="KIND_GPU"))
    assert _field(out, r"^max_batch_size: (\d+)") == "16"
    assert _field(out, r"max_queue_delay_microseconds: (\d+)") == "5000"
    assert _field(out, r'"LLM_MAX_BATCH_SIZE" value: \{ string_value: "(\d+)"') == "16"
    assert _field(out, r"instance_group \[ \{ kind: (KIND_\w+)") == "KIND_GPU"
    assert _field(out, r"preferred_batch_size: \[([^\]]*)\]").split(",") == [" 4", " 8 "]


def test_preferred_sizes_that_no_longer_fit_are_dropped() -> None:
    out = apply_batching(SHIPPED, DynamicBatching(max_batch_size=4))
    assert _field(out, r"preferred_batch_size: \[([^\]]*)\]").strip() == "4"
    out = apply_batching(SHIPPED, DynamicBatching(max_batch_size=2))
    assert "preferred_batch_size" not in out and _field(out, r"^max_batch_size: (\d+)") == "2"
    assert apply_batching(SHIPPED, DynamicBatching()) == SHIPPED


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"max_batch_size": 0}, "max_batch_size must be 1-256"),
    ({"max_queue_delay_us": -1}, "max_queue_delay_us must be"),
    ({"instance_kind": "GPU"}, "KIND_GPU or KIND_CPU"),
])
def test_bad_settings_are_refused_with_the_allowed_values(kwargs: dict, words: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(BatchingConfigError, match=words):
        DynamicBatching(**kwargs)
    with pytest.raises(BatchingConfigError, match="no max_queue_delay_microseconds"):
        apply_batching("max_batch_size: 8\n", DynamicBatching(max_queue_delay_us=10))


def test_the_served_copy_gets_the_batching(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cosyedge_cloud.triton.launcher import LaunchSettings, prepare_repository

    repo = prepare_repository(LaunchSettings(batching=DynamicBatching(max_batch_size=4, max_queue_delay_us=100)),
                              tmp_path)
    served = (repo / "cosyvoice2" / "config.pbtxt").read_text()
    assert _field(served, r"^max_batch_size: (\d+)") == "4"
    assert _field(served, r"max_queue_delay_microseconds: (\d+)") == "100"
    assert (REPOSITORY / "cosyvoice2" / "config.pbtxt").read_text() == SHIPPED  # the checkout is untouched
