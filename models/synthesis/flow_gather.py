"""Later chunks' flow started together (graph_flow_gather_ms), so that the batched estimator lanes
replay several streams at once after the first chunks.

Why: a batched replay serves the streams at one Euler step, and a stream's ten steps run one after
another, so streams whose chunks start apart never share one. At sixteen streams on an H100 (docs/gpu.md,
twenty-seventh run) 700 of 807 estimator replays served one stream (5.4 ms each, against 16.7 ms for all
sixteen): the first chunks start together and share, the later ones drift apart. A stream whose audio is
already queued ahead of playback can wait a little before its next chunk's flow without being heard, while
its LLM keeps decoding on its producer thread; streams that start a chunk's flow together then go through
its ten steps together (flow_order: the streams of the last replay come back for the next step).

The rule (FlowGather): a later chunk, its encoder done, holds before its first estimator step for at most
min(graph_flow_gather_ms, the stream's queued audio less GATHER_MARGIN_S). The holders are released
together when every seated stream (StreamSeats: the streams on the lanes) is holding, or when the first
holder's time is up, and the estimator batcher is told to expect them at its first step. A first chunk, an
offline request and a stream without queued audio never hold."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Queued audio a held stream keeps: its own chunk's flow and vocoder still run after the hold (at sixteen
# streams on an H100 a chunk's flow took up to ~220 ms and its vocoder ~50: twenty-seventh run).
GATHER_MARGIN_S = 0.5
MAX_GATHER_MS = 1000  # the setting's bound: longer holds would be heard as a late chunk where slack is short


@dataclass
class GatherStats:
    holds: int = 0  # chunks that held
    held_s: float = 0.0
    rounds: int = 0  # releases
    full_rounds: int = 0  # releases because every seated stream held
    largest_round: int = 0  # the most streams released together

    def as_dict(self) -> dict[str, object]:
        return {"gather_holds": self.holds, "gather_held_ms": round(self.held_s * 1e3, 1),
                "gather_rounds": self.rounds, "gather_full_rounds": self.full_rounds,
                "gather_largest_round": self.largest_round}


def hold_budget_s(max_hold_s: float, queued_audio_s: float, margin_s: float = GATHER_MARGIN_S) -> float:
    """How long a later chunk may hold: at most `max_hold_s`, and only out of the audio it has queued beyond
    `margin_s`; 0 where it has none to spare."""
    return max(0.0, min(max_hold_s, queued_audio_s - margin_s))


def queued_audio_s(audio_sent_s: float, first_audio_at: float, now: float) -> float:
    """The audio a stream has sent that is still ahead of playback, if playback began at its first audio."""
    return audio_sent_s - (now - first_audio_at)


class FlowGather:
    """Holds later chunks' flow starts into rounds (module docstring). `seated()` counts the streams that
    could join a round (those on the lanes)."""

    def __init__(self, max_hold_s: float, seated: Callable[[], int],
                 released: Callable[[list[int]], None] = lambda threads: None) -> None:
        if not 0 < max_hold_s <= MAX_GATHER_MS / 1e3:
            raise ValueError(f"a gather holds 0 < s <= {MAX_GATHER_MS / 1e3}, got {max_hold_s}")
        self.max_hold_s = max_hold_s
        self._seated = seated
        # told the threads of each round it releases (FlowBatcher.expect: their first estimator calls come
        # next, and the first of them must not run alone on an idle graph thread before the others queue)
        self._released = released
        self._cond = threading.Condition()
        self._round = 0
        self._holding: list[int] = []  # the threads holding in this round
        self.stats = GatherStats()

    def hold(self, budget_s: float) -> float:
        """Wait until this round is released, at most `budget_s` (hold_budget_s); the seconds held."""
        if budget_s <= 0:
            return 0.0
        start = time.monotonic()
        deadline = start + budget_s
        with self._cond:
            mine = self._round
            self._holding.append(threading.get_ident())
            self.stats.holds += 1
            if len(self._holding) >= self._seated():
                self._release(full=True)
            while self._round == mine:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._release(full=False)
                    break
                self._cond.wait(left)
            held = time.monotonic() - start
            self.stats.held_s += held
        return held

    def _release(self, full: bool) -> None:
        """Every holder of this round goes (under the condition's lock)."""
        s = self.stats
        s.rounds += 1
        s.full_rounds += full
        s.largest_round = max(s.largest_round, len(self._holding))
        if len(self._holding) > 1:
            self._released(self._holding)
        self._holding = []
        self._round += 1
        self._cond.notify_all()

    def report(self) -> dict[str, object]:
        with self._cond:
            return self.stats.as_dict()
