"""The device side of the end-to-end tests: the daemon's Service in this
process (local engine: the CosyVoice tiny bundle; fallback: espeak-ng when
installed) with the cloud engine on, a MemorySink as its speaker, and a
probe client that sends `tts/say` and watches the answers and the cloud
request topic."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from cosyedge_daemon.api.tts_messages import decode_audio
from cosyedge_daemon.service.service import Service
from cosyedge_daemon.synthesizers.espeak import EspeakSynthesizer
from cosyedge_models.synthesis.api import Synthesizer

from tests.daemon.conftest import make_settings
from tests.support.memory_sink import MemorySink
from tests.support.mqtt_recorder import Received, Recorder


def load_local(bundle: Path) -> Synthesizer:
    from cosyedge_models.synthesis.synthesizer import load_synthesizer

    return load_synthesizer(bundle)


class Edge:
    def __init__(
        self,
        broker_url: str,
        local: Synthesizer | None,
        sink_speed: float = 20.0,
        device_id: str | None = None,
        **sections: Any,
    ) -> None:
        self.device_id = device_id or f"edge{uuid.uuid4().hex[:6]}"
        sections.setdefault("cloud", {}).setdefault("enabled", True)
        self.settings = make_settings(broker_url, self.device_id, **sections)
        self.sink = MemorySink(sample_rate=24000, speed=sink_speed)
        self.service = Service(self.settings, sink=self.sink)
        fallback = EspeakSynthesizer(sample_rate=24000) if shutil.which("espeak-ng") else None
        self.service.set_synthesizers(local, fallback)
        self.service.start(connect_timeout_s=10)
        self.prefix = self.settings.topic_prefix
        self.probe = Recorder(broker_url, [f"{self.prefix}/tts/#", f"cosyedge/{self.device_id}/cloud/request"])

    def say(self, rid: str, text: str, **fields: Any) -> float:
        """Send a request; returns the monotonic time it was sent."""
        return self.probe.publish(f"{self.prefix}/tts/say", {"id": rid, "text": text, **fields})

    def answer(self, rid: str, timeout_s: float) -> Received:
        """The request's done or error message."""
        ends = (f"{self.prefix}/tts/done/{rid}", f"{self.prefix}/tts/error/{rid}")
        return self.probe.wait_for(lambda m: m.topic in ends, timeout_s)

    def audio(self, rid: str) -> np.ndarray:
        """The published audio of a request, in order, as int16."""
        chunks = [decode_audio(m.payload, m.user_properties) for m in self.probe.on(f"{self.prefix}/tts/audio/{rid}")]
        assert [c.seq for c in chunks] == list(range(len(chunks))), "published chunks out of order or repeated"
        return np.frombuffer(b"".join(c.pcm16 for c in chunks), "<i2") if chunks else np.zeros(0, np.int16)

    def played_samples(self) -> int:
        return sum(int(b.size) for b in self.sink.played)

    def cloud_requests(self) -> list[Received]:
        return self.probe.on(f"cosyedge/{self.device_id}/cloud/request")

    def close(self) -> None:
        self.probe.close()
        if self.service.state != "stopped":
            self.service.stop(timeout_s=1.0)
