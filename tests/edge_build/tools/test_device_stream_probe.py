"""edge_build/tools/device_stream_probe.py's first-audio-first part on the CPU
(the tiny bundle's captured stages run there without capture): with the holds
on, every stream's first chunk has its "hold" in the timeline and the graph
thread counts one hold a stream; off, none; the summary the device run prints."""

from __future__ import annotations

from pathlib import Path

from cosyedge_build.tools.device_stream_probe import first_audio_first_on_off, summary
from cosyedge_models.synthesis.settings import SynthesisSettings


def test_first_audio_first_on_and_off(graph_bundle: Path) -> None:
    settings = SynthesisSettings(threads=1, overlap_stages=True, graph_flow=True, graph_decode=True,
                                 graph_flow_slots=2, graph_decode_slots=2)
    # a short text: it fits the tiny bundle's fixed-size LLM step (LLM work on the graph thread)
    part = first_audio_first_on_off(graph_bundle, settings, runs=1, streams=2, text="Eight at once.")
    on, off = part["first_audio_first_on"], part["first_audio_first_off"]
    for label, result in (("on", on), ("off", off)):
        streams = result["alone"] + result["concurrent"]
        assert len(streams) == 3 and all(s["first_audio_ms"] > 0 for s in streams), label
        held = [0 in s["per_chunk"] and "hold" in s["per_chunk"][0] for s in streams]
        assert held == [label == "on"] * 3
        assert not any("hold" in stages for s in streams for chunk, stages in s["per_chunk"].items() if chunk)
    (counters,) = on["graph_order"]["after_concurrent"].values()  # one graph thread
    assert counters["holds"] == 1 + 1 + 2  # warm-up, the stream alone, the two together
    assert counters["runs"]["first_audio"] > 0 and counters["runs"]["llm"] > 0
    (counters_off,) = off["graph_order"]["after_concurrent"].values()
    assert counters_off["holds"] == 0 and counters_off["runs"]["first_audio"] == 0
    assert counters_off["runs"]["normal"] > 0 and counters_off["runs"]["llm"] > 0  # in submission order
    short = summary({"first_audio_first": part})
    assert set(short) == {"first_audio_first_on", "first_audio_first_off"}
    assert short["first_audio_first_on"]["graph_order"] == on["graph_order"]["after_concurrent"]
    assert "hold" in short["first_audio_first_on"]["alone_chunk0"]
