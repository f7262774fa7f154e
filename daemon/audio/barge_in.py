"""Barge-in, pure logic: what to do with the playback when the VAD hears
speech while the daemon is speaking. The daemon applies the action (stop:
flush the sink and end the request with reason `interrupted`; duck / unduck:
`sink.set_gain`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cosyedge_daemon.audio.interfaces import VadEvent
from cosyedge_daemon.settings.audio import VadSettings

ActionKind = Literal["none", "stop", "duck", "unduck"]


@dataclass(frozen=True)
class BargeInAction:
    kind: ActionKind
    gain: float = 1.0  # the playback gain to set for duck / unduck


NONE = BargeInAction("none")


class BargeInPolicy:
    """speech_start while speaking -> stop | duck(duck_gain) | none (per
    `barge_in`); speech_end or the end of speaking while ducked -> unduck.
    Not thread-safe: call it from the one thread that handles VAD events."""

    def __init__(self, settings: VadSettings) -> None:
        self.mode = settings.barge_in
        self.duck_gain = settings.duck_gain
        self._ducked = False

    @property
    def ducked(self) -> bool:
        return self._ducked

    def on_vad_event(self, event: VadEvent, speaking: bool) -> BargeInAction:
        if event.kind == "speech_start":
            if not speaking or self.mode == "off":
                return NONE
            if self.mode == "stop":
                return BargeInAction("stop")
            if self._ducked:
                return NONE
            self._ducked = True
            return BargeInAction("duck", self.duck_gain)
        if self._ducked:  # speech_end: the user stopped talking over us
            self._ducked = False
            return BargeInAction("unduck", 1.0)
        return NONE

    def on_speaking_changed(self, speaking: bool) -> BargeInAction:
        """When playback ends while ducked, restore the gain for the next request."""
        if not speaking and self._ducked:
            self._ducked = False
            return BargeInAction("unduck", 1.0)
        return NONE
