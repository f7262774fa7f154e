"""Streaming text (synthesize-chunk) cut into sentences as soon as each is
complete, with the project's sentence splitter (models/text/split.py). Pure
logic: text in, complete sentences out; the rest waits for more text or for
synthesize-stop."""

from __future__ import annotations

from cosyedge_models.text.split import complete_sentences, cut_sentences


class SentenceBuffer:
    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self._pending = ""
        self.total_chars = 0

    def add(self, text: str) -> list[str]:
        """Append a chunk (any split: mid-word, mid-sentence); the sentences it completed.
        ValueError when the whole streamed text grows beyond max_chars."""
        self.total_chars += len(text)
        if self.total_chars > self.max_chars:
            raise ValueError(f"the streamed text has {self.total_chars} characters; the limit is {self.max_chars}")
        done, self._pending = complete_sentences(self._pending + text)
        return done

    def finish(self) -> list[str]:
        """synthesize-stop: whatever is left, as sentences."""
        rest, self._pending = self._pending, ""
        return cut_sentences(rest)

    @property
    def pending(self) -> str:
        return self._pending
