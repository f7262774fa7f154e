"""When to turn speech tokens into audio while the LLM is still generating:
pure scheduling logic, no I/O.

Upstream CosyVoice 2 (`CosyVoice2Model.tts`, stream=True): a chunk is
vocoded once `hop + pre_lookahead_len` new tokens exist; the first hop is
stretched so that prompt tokens + first hop end on a multiple of the hop
(the flow's static attention chunks then line up with the audio chunks); the
tokens left when the LLM finishes form the final chunk. Each request has
its own schedule (upstream keeps the hop on the shared model instance)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from cosyedge_models.bundle.loader import STATIC_FLOW_PREFIX, Bundle

log = logging.getLogger(__name__)


def check_first_hop(first_hop: int | None, samples_per_token: int, held_back_samples: int) -> None:
    """A first hop whose audio is no longer than what the vocoder holds back for the next chunk's
    cross-fade would send an empty first chunk and leave the cross-fade short (a broadcast error in
    the second chunk): ValueError with the least first hop this bundle takes. None: upstream's hop."""
    least = held_back_samples // samples_per_token + 1
    if first_hop is not None and first_hop < least:
        raise ValueError(f"first_hop_tokens must be at least {least} for this bundle (its vocoder holds back "
                         f"{held_back_samples} samples for the cross-fade, {samples_per_token} a token), "
                         f"got {first_hop}")


def check_hops(bundle: Bundle, first_hop: int | None, hop_scale: float, max_hop: int | None) -> None:
    """At load: the first hop (check_first_hop) and the grown hop's cap against `bundle`. A cap below
    the bundle's hop: ValueError. With the hop growing, a cap whose chunks' estimator window outgrows
    the bundle's largest fixed-shape window: a warning, with the largest cap that fits and is a multiple
    of the hop (such chunks would move their stream off the captured graphs, the batched lanes included;
    a multiple keeps every chunk's end on the flow's attention chunks, as upstream's growth does)."""
    check_first_hop(first_hop, bundle.token_mel_ratio * bundle.hift.upsample_factor,
                    bundle.streaming.source_cache_len)
    hop = bundle.streaming.token_hop_len
    if max_hop is not None and max_hop < hop:
        raise ValueError(f"max_hop_tokens must be at least the bundle's hop of {hop} speech tokens, got {max_hop}")
    windows = [int(name[len(STATIC_FLOW_PREFIX):]) for name in bundle.stages if name.startswith(STATIC_FLOW_PREFIX)]
    grown = grown_hops(hop, hop_scale, max_hop)[-1]
    ratio, lookahead = bundle.token_mel_ratio, bundle.flow.pre_lookahead_len
    if windows and (grown + lookahead) * ratio > max(windows):
        log.warning("streaming: later chunks of %d speech tokens need estimator windows of %d frames, more than "
                    "the bundle's largest fixed-shape window (%d): those chunks leave the captured graphs; "
                    "max_hop_tokens %d would keep them there", grown, (grown + lookahead) * ratio, max(windows),
                    max(hop, (max(windows) // ratio - lookahead) // hop * hop))


def grown_hops(hop: int, hop_scale: float, max_hop: int | None = None) -> list[int]:
    """The hops a stream's later chunks take, in order, each once (ChunkSchedule's growth: times
    `hop_scale` after each chunk, up to `max_hop`, None: 4 x the hop as upstream); [hop] for a fixed hop."""
    cap = max_hop if max_hop is not None else 4 * hop
    hops = [hop]
    while hop_scale > 1.0 and (nxt := min(cap, int(hops[-1] * hop_scale))) > hops[-1]:
        hops.append(nxt)
    return hops


@dataclass(frozen=True)
class Chunk:
    start: int  # first token of this chunk's audio (offset)
    end: int  # one past its last token; tokens[end:end + lookahead] are context only
    final: bool


@dataclass
class ChunkSchedule:
    hop: int
    lookahead: int
    prompt_tokens: int = 0
    first_hop: int | None = None  # None: upstream's aligned first hop
    # Upstream's stream_scale_factor: after each chunk the hop grows by this
    # factor, up to max_hop (upstream: 4 x the hop). Fewer, longer windows cost
    # less per frame once the first audio is out; 1.0: a fixed hop.
    hop_scale: float = 1.0
    max_hop: int | None = None  # None: 4 x hop
    # No first audio to hurry (an offline request served as a stream): with a growing hop every chunk
    # takes the hop it grows to at once, the first aligned down to the prompt (first_hop is for first audio).
    grown_start: bool = False
    offset: int = 0
    _hop: int = 0  # the hop after the first chunk, grown by hop_scale
    _grown_first: int = 0  # grown_start's first hop (0: the streaming first hop)
    _grown: list[int] = field(default_factory=list)  # the hops it grows through (grown_hops)

    def __post_init__(self) -> None:
        if self.hop <= 0:
            raise ValueError(f"hop must be positive, got {self.hop}")
        if self.lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {self.lookahead}")
        if self.hop_scale < 1.0:
            raise ValueError(f"hop_scale must be >= 1.0, got {self.hop_scale}")
        if self.max_hop is not None and self.max_hop < self.hop:
            raise ValueError(f"max_hop must be >= hop ({self.hop}), got {self.max_hop}")
        self._hop = self.hop
        self._grown = grown_hops(self.hop, self.hop_scale, self.max_hop)
        grown = self._grown[-1]
        # the largest first hop up to the grown one that ends on a whole chunk after the prompt; one shorter
        # than the hop (a cap below twice the hop) would be a tiny chunk: the streaming first hop then
        first = grown - (self.prompt_tokens + grown) % self.hop
        if self.grown_start and grown > self.hop and first >= self.hop:
            self._hop, self._grown_first = grown, first

    def _first_hop(self) -> int:
        if self._grown_first:
            return self._grown_first
        if self.first_hop is not None:
            return self.first_hop
        pad = -self.prompt_tokens % self.hop
        return self.hop + pad

    def _this_hop(self) -> int:
        return self._hop if self.offset > 0 else self._first_hop()

    def first_chunk_tokens(self) -> int:
        """The speech tokens the first chunk waits for (its hop and the look-ahead)."""
        return self._first_hop() + self.lookahead

    def next_chunk_tokens(self) -> int:
        """The tokens (in all) at which `next_chunk` gives the next chunk."""
        return self.offset + self._this_hop() + self.lookahead

    def next_chunk(self, n_tokens: int) -> Chunk | None:
        """The next chunk that `n_tokens` generated tokens allow, or None. Call
        repeatedly: several chunks may be ready at once."""
        hop = self._this_hop()
        if n_tokens - self.offset >= hop + self.lookahead:
            chunk = Chunk(self.offset, self.offset + hop, final=False)
            self._hop = self._grown[min(self._grown.index(self._hop) + 1, len(self._grown) - 1)]
            self.offset += hop
            return chunk
        return None

    def final_chunk(self, n_tokens: int) -> Chunk:
        """What remains once the LLM has finished (may be empty)."""
        chunk = Chunk(self.offset, n_tokens, final=True)
        self.offset = n_tokens
        return chunk


def recurring_mel_frames(hop: int, token_mel_ratio: int, mel_cache_len: int,
                         first_hop: int | None = None) -> tuple[int, int]:
    """The vocoder's mel lengths that every stream of a prompt-less voice
    repeats: its first chunk (the first hop's frames) and a steady chunk
    (a hop's frames after the kept mel overlap)."""
    return (first_hop or hop) * token_mel_ratio, hop * token_mel_ratio + mel_cache_len


def stream_mel_frames(hop: int, token_mel_ratio: int, mel_cache_len: int, first_hop: int | None = None,
                      hop_scale: float = 1.0, max_hop: int | None = None) -> list[int]:
    """Every mel length the vocoder repeats in each stream of a prompt-less voice: the first chunk's
    and the steady chunk's of each hop the schedule grows to (grown_hops), and with a growing hop an
    offline request's first chunk at the grown hop (ChunkSchedule.grown_start); in order, each once."""
    first, steady = recurring_mel_frames(hop, token_mel_ratio, mel_cache_len, first_hop)
    hops = grown_hops(hop, hop_scale, max_hop)
    later = [recurring_mel_frames(h, token_mel_ratio, mel_cache_len)[1] for h in hops[1:]]
    offline = ChunkSchedule(hop, 0, first_hop=first_hop, hop_scale=hop_scale, max_hop=max_hop,
                            grown_start=True).first_chunk_tokens()
    return list(dict.fromkeys([first, steady, *later, offline * token_mel_ratio]))
