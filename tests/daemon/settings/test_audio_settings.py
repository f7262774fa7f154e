from __future__ import annotations

import dataclasses

import pytest
from cosyedge_daemon.settings.audio import AudioSettings, AudioSettingsError, VadSettings


def test_defaults_are_valid_and_documented_values() -> None:
    vad = VadSettings()
    assert (vad.aggressiveness, vad.frame_ms, vad.barge_in, vad.half_duplex) == (3, 30, "stop", False)
    assert vad.frame_samples == 480 and vad.frames(vad.hangover_ms) == 20
    audio = AudioSettings()
    assert audio.output_device == "default" and audio.capture


def test_from_mapping_builds_and_converts() -> None:
    vad = VadSettings.from_mapping({"aggressiveness": 1, "frame_ms": 10, "duck_gain": 1, "barge_in": "duck"})
    assert vad.aggressiveness == 1 and vad.frame_ms == 10 and vad.duck_gain == 1.0
    assert isinstance(vad.duck_gain, float)
    audio = AudioSettings.from_mapping({"output_device": 3, "input_device": "USB", "output_rate_hz": 48000})
    assert audio.output_device == 3 and audio.output_rate_hz == 48000


@pytest.mark.parametrize(("cls", "data", "message"), [
    (VadSettings, {"aggressivness": 2}, r"\[vad\] unknown key aggressivness; known keys: enabled, aggressiveness, "),
    (VadSettings, {"aggressiveness": 4}, r"\[vad\] aggressiveness = 4: allowed values: 0, 1, 2, 3"),
    (VadSettings, {"frame_ms": 25}, r"frame_ms = 25: allowed values: 10, 20, 30"),
    (VadSettings, {"frame_ms": "30"}, r'frame_ms: expected an integer, got "30"'),
    (VadSettings, {"half_duplex": 1}, r"half_duplex: expected true or false, got 1"),
    (VadSettings, {"aggressiveness": True}, r"aggressiveness: expected an integer, got true"),
    (VadSettings, {"enabled": "no"}, r'enabled: expected true or false, got "no"'),
    (VadSettings, {"barge_in": "pause"}, r'barge_in = "pause": allowed values: "off", "stop", "duck"'),
    (VadSettings, {"duck_gain": 1.5}, r"duck_gain = 1.5: must be between 0.0 and 1.0"),
    (VadSettings, {"start_voiced_ms": 300}, r"start_voiced_ms = 300: allowed values: 30..start_window_ms"),
    (VadSettings, {"post_roll_ms": 900}, r"post_roll_ms = 900: allowed values: 0..hangover_ms \(600\)"),
    (VadSettings, {"max_utterance_ms": 500}, r"max_utterance_ms = 500: must be between 1000 and 600000"),
    (VadSettings, {"half_duplex": True},
     r'half_duplex = true with barge_in = "stop" is invalid.*barge_in = "off"'),
    (AudioSettings, {"output_device": ""}, r'output_device = "": allowed values: "none", "default"'),
    (AudioSettings, {"input_device": -1}, r'input_device = -1: allowed values: "none"'),
    (AudioSettings, {"output_device": "wav:"}, r'output_device = "wav:": allowed values'),
    (AudioSettings, {"output_device": 1.5}, r"output_device: expected a string or an integer, got 1.5"),
    (AudioSettings, {"output_rate_hz": 1000}, r"output_rate_hz = 1000: must be between 8000 and 192000"),
    (AudioSettings, {"resample_quality": "best"}, r'resample_quality = "best": allowed values: "QQ", "LQ"'),
    (AudioSettings, {"capture": "yes"}, r'capture: expected true or false, got "yes"'),
])
def test_invalid_settings_name_field_and_allowed_values(cls: type, data: dict, message: str) -> None:
    with pytest.raises(AudioSettingsError, match=message):
        cls.from_mapping(data)


def test_half_duplex_without_barge_in_is_valid_and_replace_validates() -> None:
    vad = VadSettings.from_mapping({"half_duplex": True, "barge_in": "off"})
    assert vad.half_duplex
    with pytest.raises(AudioSettingsError, match="frame_ms"):
        dataclasses.replace(vad, frame_ms=15)
    with pytest.raises(ValueError):  # AudioSettingsError is a ValueError too, for generic config loaders
        VadSettings.from_mapping({"frame_ms": 15})
    with pytest.raises(AudioSettingsError, match="must be a table"):
        VadSettings.from_mapping([("frame_ms", 30)])  # type: ignore[arg-type]
