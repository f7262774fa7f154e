"""Property-based fuzzing (hypothesis) of config files: whatever a file
holds, loading it gives valid Settings (whose topics and ids the daemon can
publish on) or a CosyEdgeError with a message (ConfigError, AudioSettingsError); never another exception. 300
examples in the default run, 10,000 in the slow suite."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest
from cosyedge_daemon.settings.loader import load_settings
from cosyedge_daemon.settings.schema import SECTIONS
from cosyedge_daemon.settings.topics import topic_problem
from cosyedge_models.errors import CosyEdgeError
from hypothesis import HealthCheck, given, settings

from tests.support.figures import record
from tests.support.fuzz import config_files

SCHEMA = {name: [f.name for f in dataclasses.fields(cls)] for name, cls in SECTIONS.items()}
SCHEMA.update({"audio": ["device", "sample_rate"], "vad": ["aggressiveness", "frame_ms"]})


def run(examples: int) -> dict[str, int]:
    counts = {"valid": 0, "config_error": 0}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cosyedge.toml"

        @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck))
        @given(data=config_files(SCHEMA))
        def one(data: bytes) -> None:
            path.write_bytes(data)
            try:
                s = load_settings(path)
            except CosyEdgeError as exc:  # ConfigError, or the audio side's AudioSettingsError
                assert str(exc)
                counts["config_error"] += 1
                return
            counts["valid"] += 1
            assert topic_problem(s.topic_prefix + "/tts/say") is None, s.topic_prefix
            assert all(topic_problem(f"hermes/audioServer/{site}/playBytes/x") is None for site in s.site_ids)

        one()
    return counts


def test_config_fuzz() -> None:
    counts = run(300)
    assert counts["valid"] > 0 and counts["config_error"] > 0, counts


@pytest.mark.slow
def test_config_fuzz_10000() -> None:
    counts = run(10_000)
    record("fuzz-config", {"examples": sum(counts.values()), **counts, "other_exceptions": 0})
    assert sum(counts.values()) == 10_000
