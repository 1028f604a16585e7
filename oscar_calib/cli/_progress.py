"""The CLI's progress: the displays of :mod:`oscar_calib.display`, and :class:`StageClock`, which
times every stage a command reports for its ``time:`` line."""

from __future__ import annotations

import time

from ..display import (  # noqa: F401  (the commands import the display from here)
    ANNOUNCE_AFTER_S,
    PLAIN_INTERVAL_S,
    _PlainDisplay,
    _RichDisplay,
    display_kind,
    progress_display,
    show_progress,
)
from ..progress import ProgressFn, step


def starting(progress: ProgressFn | None):
    """The stage around a command's heavy imports (torch, transformers: seconds on a busy machine),
    so a display says something before the first stage of the work."""
    return step(progress, "starting")


class StageClock:
    """Times every stage a command reports, drawn or not (a display hides stages under two
    seconds), and passes each report on to ``inner``. Started when the command starts, so
    :meth:`breakdown` accounts for all of it: the stages, and ``other`` for the rest (start-up
    and imports before the first stage, writing files, anything between stages)."""

    def __init__(self, inner: ProgressFn | None = None, clock=time.perf_counter):
        self.inner, self.clock = inner, clock
        self.started = clock()
        self.seconds: dict[str, float] = {}
        self.current: str | None = None
        self.since = 0.0

    def __call__(self, stage: str, done: int, total: int | None = None, unit: str = "") -> None:
        now = self.clock()
        if stage != self.current:
            self._close(now)
            self.current, self.since = stage, now
        if total is not None and done >= total:
            self._close(now)
        if self.inner is not None:
            self.inner(stage, done, total, unit)

    def wrap(self, inner: ProgressFn | None) -> "StageClock":
        """This clock, passing reports on to ``inner`` (a display, or None)."""
        self.inner = inner
        return self

    def _close(self, now: float) -> None:
        if self.current is not None:
            self.seconds[self.current] = self.seconds.get(self.current, 0.0) + now - self.since
            self.current = None

    def breakdown(self) -> tuple[list[tuple[str, float]], float]:
        """``([(stage, seconds), ..., ("other", seconds)], total)`` in tenths of a second whose
        parts add up to the total exactly (each rounded once, the rest is ``other``)."""
        now = self.clock()
        self._close(now)
        parts = [(name, round(sec * 10)) for name, sec in self.seconds.items()]
        total = max(round((now - self.started) * 10), sum(t for _, t in parts))   # roundings may pass it
        parts.append(("other", total - sum(t for _, t in parts)))
        return [(name, t / 10) for name, t in parts], total / 10

    def line(self) -> str:
        """``time: loading model 8.7 s, capture 14.6 s, ..., other 1.9 s; total 49.8 s``."""
        parts, total = self.breakdown()
        return "time: " + ", ".join(f"{name} {sec:.1f} s" for name, sec in parts) + f"; total {total:.1f} s"

    def to_dict(self) -> dict:
        """``{"total_s", "stages": [[stage, seconds], ...] in the order they ran, "other_s"}``."""
        parts, total = self.breakdown()
        return {"total_s": total, "stages": [list(p) for p in parts[:-1]], "other_s": parts[-1][1]}


