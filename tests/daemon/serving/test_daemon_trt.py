"""The daemon serving the `trt` backend (TensorRT engines of the tiny bundle, under the
emulator in the default run, tests/support/trt_runtime.py): one MQTT say and one Wyoming
synthesize, both answered with audio by the local engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cosyedge_models.synthesis.settings import SynthesisSettings
from cosyedge_models.synthesis.synthesizer import load_synthesizer
from wyoming.tts import Synthesize

from tests.daemon.conftest import DaemonFactory
from tests.support.module_tmp import ModuleTmp
from tests.support.trt_emulator import Emulation
from tests.support.trt_runtime import build_trt_bundle, trt_runtime
from tests.support.wyoming_client import exchange, run, tts_port

__all__ = ["trt_runtime"]


@pytest.fixture(scope="module")
def trt_bundle(trt_runtime: Emulation | None, tiny_bundle: Path,  # noqa: F811
               module_tmp: ModuleTmp) -> Path:
    return build_trt_bundle(tiny_bundle, module_tmp.mktemp("trt-daemon") / "bundle")


def test_mqtt_say_and_wyoming_synthesize_on_trt(daemons: DaemonFactory, trt_bundle: Path) -> None:
    engine = load_synthesizer(trt_bundle, settings=SynthesisSettings(backend="trt"))
    assert engine.name == "cosyvoice-trt"
    svc = daemons.start(local=engine, fallback=None, wyoming={"uri": "tcp://127.0.0.1:0", "zeroconf": "off"})
    p = daemons.probe(svc)
    pre = svc.settings.topic_prefix
    # a seed: the tiny model's random weights make EOS likely enough that a rare seed draws it 100 times
    # before the minimum length (sampling.py's error); Wyoming has no seed to give (0-59 drew none)
    p.publish(f"{pre}/tts/say", {"id": "t1", "text": "Hello from the TensorRT engines.", "output": "publish",
                                 "seed": 3})
    done = p.wait_topic(f"{pre}/tts/done/t1", 300).json()
    assert (done["route"], done["reason"]) == ("local", "completed") and done["audio_seconds"] > 0, done
    got = run(exchange(tts_port(svc), [Synthesize(text="And hello over Wyoming, one two three.").event()],
                       ("audio-stop", "error"), timeout_s=300))
    kinds = [e.type for e in got]
    assert kinds[0] == "audio-start" and kinds[-1] == "audio-stop" and kinds.count("audio-chunk") >= 2, kinds
    pcm = np.frombuffer(b"".join(e.payload or b"" for e in got if e.type == "audio-chunk"), "<i2")
    assert pcm.size > 0 and np.abs(pcm).max() > 0
