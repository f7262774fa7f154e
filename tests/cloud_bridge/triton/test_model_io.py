"""The tensor contract between the bridge and the Triton model."""

from __future__ import annotations

import numpy as np
import pytest
from cosyedge_cloud.triton.launcher import set_parameters
from cosyedge_cloud.triton.model_io import (
    BadTensors,
    error_message,
    model_chunk,
    parse_error,
    request_tensors,
    response_tensors,
    synthesis_request,
)
from cosyedge_cloud.triton.orchestrator import resolve_bundle
from cosyedge_models.errors import CosyEdgeError


def test_request_tensors_round_trip() -> None:
    prompt = np.linspace(-0.5, 0.5, 321, dtype=np.float32)
    t = request_tensors(
        "hello",
        mode="zero_shot",
        voice="v",
        prompt_pcm=prompt,
        prompt_sample_rate=16000,
        prompt_text="ref",
        seed=3,
        speed=1.0,
        stream=False,
    )
    assert t["TEXT"].shape == (1, 1) and t["PROMPT_PCM"].shape == (1, 321)
    req = synthesis_request(t)
    assert (req.text, req.mode, req.voice, req.seed, req.stream) == ("hello", "zero_shot", "v", 3, False)
    assert req.prompt is not None and req.prompt.sample_rate == 16000 and req.prompt.text == "ref"
    np.testing.assert_array_equal(req.prompt.pcm, prompt)


def test_bad_tensors_are_refused() -> None:
    t = request_tensors("hi")
    t["PARAMS"] = np.array([[b"{"]], dtype=np.object_)
    with pytest.raises(BadTensors, match="PARAMS"):
        synthesis_request(t)
    t = request_tensors("hi", mode="sing")
    with pytest.raises(BadTensors, match="mode"):
        synthesis_request(t)
    with pytest.raises(BadTensors, match="TEXT"):
        synthesis_request({"PARAMS": t["PARAMS"]})


def test_response_tensors_round_trip() -> None:
    out = response_tensors(np.ones(10, np.float32), 24000, 2, True, {"llm_ms": 1.5})
    chunk = model_chunk(out, "2")
    assert (chunk.sample_rate, chunk.index, chunk.last, chunk.model_version) == (24000, 2, True, "2")
    assert chunk.times == {"llm_ms": 1.5} and chunk.pcm.shape == (10,)
    with pytest.raises(BadTensors):
        model_chunk({"AUDIO": out["AUDIO"]})


def test_error_messages_survive_triton_prefixes() -> None:
    msg = "in ensemble: " + error_message("request", "unknown_voice", "voice 'x' is unknown")
    assert parse_error(msg) == ("request", "unknown_voice", "voice 'x' is unknown")
    assert parse_error("Request for unknown model") is None


def test_bundle_resolution_order(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model_dir = tmp_path / "cosyvoice2"
    (model_dir / "1").mkdir(parents=True)
    with pytest.raises(CosyEdgeError, match="no model bundle"):
        resolve_bundle(model_dir, "1", {}, environ={})
    assert resolve_bundle(model_dir, "1", {}, environ={"COSYEDGE_BUNDLE": "/e"}).as_posix() == "/e"
    assert resolve_bundle(model_dir, "1", {"BUNDLE_DIR": "/p"}, environ={"COSYEDGE_BUNDLE": "/e"}).as_posix() == "/p"
    (tmp_path / "b").mkdir()
    (model_dir / "1" / "bundle").symlink_to(tmp_path / "b")
    assert resolve_bundle(model_dir, "1", {"BUNDLE_DIR": "/p"}, environ={}) == (tmp_path / "b").resolve()


def test_set_parameters_replaces_and_adds() -> None:
    config = 'name: "m"\nparameters: { key: "ENGINE_BACKEND" value: { string_value: "ort" } }\n'
    out = set_parameters(config, {"ENGINE_BACKEND": "trt", "NEW": 'a"b'})
    assert 'key: "ENGINE_BACKEND" value: { string_value: "trt" }' in out
    assert 'key: "NEW" value: { string_value: "a\\"b" }' in out
    assert out.count("ENGINE_BACKEND") == 1
