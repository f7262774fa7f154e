"""Property-based fuzzing (hypothesis) of the Wyoming input surface: the
frame reader on arbitrary bytes, and the streaming sentence buffer on any
text cut anywhere."""

from __future__ import annotations

import asyncio

from cosyedge_daemon.wyoming.framing import FrameError, read_event
from cosyedge_daemon.wyoming.streaming import SentenceBuffer
from cosyedge_models.text.split import cut_sentences as split_sentences
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.wyoming_client import raw_frame


def _read_all(data: bytes, max_bytes: int = 4096) -> list[str]:
    async def go() -> list[str]:
        reader = asyncio.StreamReader(limit=65536)
        reader.feed_data(data)
        reader.feed_eof()
        kinds = []
        while True:
            try:
                event = await read_event(reader, max_bytes, 1.0, 0.05)
            except FrameError as exc:
                kinds.append(f"!{exc.code}")
                return kinds
            if event is None:
                return kinds
            kinds.append(event.type)

    return asyncio.run(go())


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_reader_on_arbitrary_bytes_ends_cleanly(data: bytes) -> None:
    kinds = _read_all(data)  # never anything but events, a FrameError, or the end
    assert all(isinstance(k, str) for k in kinds)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text(min_size=1, max_size=12), st.dictionaries(st.text(max_size=5), st.integers()),
                          st.binary(max_size=50)), max_size=5), st.binary(max_size=30))
def test_valid_frames_then_garbage(events: list[tuple[str, dict, bytes]], tail: bytes) -> None:  # type: ignore[type-arg]
    data = b"".join(raw_frame(k, d or None, p) for k, d, p in events)
    kinds = _read_all(data + tail)
    assert kinds[: len(events)] == [k for k, _, _ in events]


_TEXT = st.text(alphabet=st.sampled_from(list("ab c.!?;\n。！世界é ")), max_size=120)


@settings(max_examples=400, deadline=None)
@given(_TEXT, st.lists(st.integers(min_value=0, max_value=120), max_size=12))
def test_streamed_sentences_equal_the_whole_text_split(text: str, cuts: list[int]) -> None:
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    buf = SentenceBuffer(10_000)
    out: list[str] = []
    for piece in pieces:
        out += buf.add(piece)
    out += buf.finish()
    assert out == split_sentences(text)
