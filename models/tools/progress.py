"""Progress of long build work (`build export`, `build quantize`): a rich
progress bar (stage, step count, elapsed time, ETA) when stderr is a
terminal, one line per finished step otherwise (CI logs, systemd, pipes:
written to stderr whatever the logging level, since build commands log only
warnings by default). rich comes with the build extra; without it the lines
are used."""

from __future__ import annotations

import logging
import sys
import time
from types import TracebackType
from typing import Any, TextIO

log = logging.getLogger(__name__)


def eta_seconds(done: int, total: int, elapsed_s: float) -> float | None:
    """Remaining time at the mean pace so far; None before the first step."""
    if done <= 0 or total <= done:
        return None if done <= 0 else 0.0
    return elapsed_s / done * (total - done)


class StageProgress:
    """`total` steps of `title`; `advance(step)` after each. `grow(n)` when
    the work turns out longer (the sensitivity pass adds builds)."""

    def __init__(self, title: str, total: int, *, stream: TextIO | None = None, bar: bool | None = None) -> None:
        self.title = title
        self.total = max(total, 1)
        self.done = 0
        self._started = time.monotonic()
        self._last = self._started
        stream = stream if stream is not None else sys.stderr
        self._stream = stream
        use_bar = stream.isatty() if bar is None else bar
        self._rich: Any = None
        self._task: Any = None
        if use_bar:
            try:
                from rich.console import Console
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    TextColumn,
                    TimeElapsedColumn,
                    TimeRemainingColumn,
                )
            except ImportError:  # the build extra is not installed: log lines
                use_bar = False
            else:
                self._rich = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                      console=Console(file=stream), transient=False)
                self._rich.start()
                self._task = self._rich.add_task(title, total=self.total)

    def grow(self, extra: int) -> None:
        self.total += max(extra, 0)
        if self._rich is not None:
            self._rich.update(self._task, total=self.total)

    def advance(self, step: str) -> None:
        now = time.monotonic()
        self.done += 1
        if self.done > self.total:
            self.total = self.done
        if self._rich is not None:
            self._rich.update(self._task, advance=1, total=self.total, description=f"{self.title}: {step}")
        else:
            eta = eta_seconds(self.done, self.total, now - self._started)
            line = (f"{time.strftime('%H:%M:%S')} {self.title}: {step} done ({self.done}/{self.total}) in "
                    f"{now - self._last:.1f} s, {now - self._started:.1f} s elapsed"
                    + ("" if eta is None else f", ETA {eta:.0f} s"))
            print(line, file=self._stream, flush=True)
            log.debug("%s", line)
        self._last = now

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None

    def __enter__(self) -> StageProgress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
