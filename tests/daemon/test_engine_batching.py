"""`[tts] llm_max_batch_size` / `llm_max_queue_delay_ms` reach the engine's LLM batcher."""

from __future__ import annotations

from pathlib import Path

from daemon.engines import load_local_engine
from daemon.settings import Settings, TtsSettings


def test_batching_settings_reach_the_engine(tiny_bundle: Path) -> None:
    off = load_local_engine(Settings(device_id="t"), bundle=str(tiny_bundle))
    on = load_local_engine(Settings(device_id="t", tts=TtsSettings(llm_max_batch_size=3, llm_max_queue_delay_ms=5)),
                           bundle=str(tiny_bundle))
    try:
        assert getattr(off, "batcher", "missing") is None
        batcher = getattr(on, "batcher", None)
        assert batcher is not None
        assert (batcher.settings.max_batch_size, batcher.settings.max_queue_delay_ms) == (3, 5)
    finally:
        off.close()
        on.close()
