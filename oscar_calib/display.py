"""Draw the library's progress reports (:mod:`oscar_calib.progress`) on stderr: what the
``oscar`` command shows, and what a script passes as ``progress=`` to draw the same.

On a terminal: a live rich display, one line per stage (bar or spinner, count, elapsed time and
time left); a finished stage stays on screen with its time. Elsewhere (CI logs, pipes): plain lines
for every stage that runs two seconds or more, one once it has run that long, at most one every
ten seconds while it runs, and one when it ends, with its time. ``OSCAR_PROGRESS`` overrides the
choice: ``rich``, ``plain`` or ``off``.

>>> from oscar_calib.display import show_progress
>>> with show_progress() as progress:
...     out = generate(model, ids, cache, max_new_tokens=32, progress=progress)
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from rich.console import Console

from .progress import ProgressFn

console = Console(stderr=True)          # progress and messages for people

PLAIN_INTERVAL_S = 10.0      # plain lines: at most one per stage this often
ANNOUNCE_AFTER_S = 2.0       # plain lines: only for stages running at least this long


class _RichDisplay:
    """A rich ``Progress`` with one task per stage, started at the first report. It draws on the
    stderr of the moment it is made, whatever replaces ``sys.stderr`` later (model loading hides
    the stray output of the libraries it calls that way)."""

    def __init__(self):
        from rich.progress import (
            BarColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(SpinnerColumn(finished_text="[green]✓[/green]"), TextColumn("{task.description:<18}"),
                            BarColumn(), TextColumn("{task.fields[count]}"), TimeElapsedColumn(),
                            TimeRemainingColumn(), console=Console(file=sys.stderr))
        self.tasks: dict[str, int] = {}
        self.current: str | None = None

    def __call__(self, stage: str, done: int, total: int | None = None, unit: str = "") -> None:
        if not self.tasks:
            self.bar.start()
        if stage != self.current:
            self._finish()
            self.current = stage
            if stage not in self.tasks:
                self.tasks[stage] = self.bar.add_task(stage, total=total, count="")
        count = f"{done}/{total} {unit}".rstrip() if total is not None and unit else ""
        self.bar.update(self.tasks[stage], completed=done, total=total, count=count)

    def _finish(self) -> None:
        """Mark the current stage finished (its elapsed time stops)."""
        if self.current is not None:
            task = self.bar.tasks[self.tasks[self.current]]
            if not task.finished:
                self.bar.update(task.id, total=task.total or 1, completed=task.total or 1)

    def close(self, ok: bool) -> None:
        if ok:
            self._finish()
        self.bar.stop()


class _PlainDisplay:
    """Plain lines on stderr for stages that run ``announce_after`` seconds or more: started, progress
    at most every ``interval`` s, done. A background ticker prints them while a stage gives no
    reports (loading a model); quicker stages print nothing, so a bad input still ends in one line.
    Lines go to the stderr of the moment it is made, whatever replaces ``sys.stderr`` later (model
    loading hides the stray output of the libraries it calls that way)."""

    def __init__(self, interval: float | None = None, announce_after: float | None = None, ticker: bool = True):
        self.interval = PLAIN_INTERVAL_S if interval is None else interval
        self.announce_after = ANNOUNCE_AFTER_S if announce_after is None else announce_after
        self.current: str | None = None
        self.started = self.last = 0.0
        self.done, self.total, self.unit, self.announced = 0, None, "", False
        self.lock = threading.Lock()
        self.file = sys.stderr
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True) if ticker else None
        if self.thread:
            self.thread.start()

    def __call__(self, stage: str, done: int, total: int | None = None, unit: str = "") -> None:
        with self.lock:
            now = time.monotonic()
            if stage != self.current:
                self._finish(now)
                self.current, self.started, self.announced = stage, now, False
            self.done, self.total, self.unit = done, total, unit
            if total is not None and done >= total:
                self._finish(now)
            else:
                self._tick(now)

    def _run(self) -> None:
        while not self.stop.wait(0.5):
            with self.lock:
                self._tick(time.monotonic())

    def _tick(self, now: float) -> None:
        if self.current is None or now - self.started < self.announce_after:
            return
        if not self.announced:
            self.announced, self.last = True, now
            self._line(f"{self.current} …" if self.total is None or not self.unit
                       else f"{self.current}: {self.total} {self.unit} …")
        elif now - self.last >= self.interval:
            self.last = now
            self._line(f"{self.current}: {self._count()}, {now - self.started:.0f} s{self._eta(now)}")

    def _count(self) -> str:
        if self.total is None:
            return "running"
        pct = f" ({self.done / self.total:.0%})" if self.total else ""
        return f"{self.done}/{self.total} {self.unit}".rstrip() + pct

    def _eta(self, now: float) -> str:
        if not self.total or not self.done:
            return ""
        left = (now - self.started) * (self.total - self.done) / self.done
        return f", about {left:.0f} s left"

    def _finish(self, now: float) -> None:
        if self.current is not None and (self.announced or now - self.started >= self.announce_after):
            count = f" ({self.total} {self.unit})" if self.total is not None and self.unit else ""
            self._line(f"{self.current}: done in {now - self.started:.1f} s{count}")
        self.current = None

    def _line(self, text: str) -> None:
        self.file.write(text + "\n")
        self.file.flush()

    def close(self, ok: bool) -> None:
        self.stop.set()
        if self.thread:
            self.thread.join()
        if ok:
            with self.lock:
                self._finish(time.monotonic())


def display_kind() -> str:
    """``rich`` on a terminal, ``plain`` elsewhere, unless ``OSCAR_PROGRESS`` says otherwise."""
    kind = os.environ.get("OSCAR_PROGRESS", "").strip().lower()
    if kind in ("rich", "plain", "off"):
        return kind
    return "rich" if console.is_terminal else "plain"


@contextmanager
def show_progress(enabled: bool = True) -> Iterator[ProgressFn | None]:
    """The progress callback for one command or script (``None`` when disabled, or with
    ``OSCAR_PROGRESS=off``): draws until the block ends. On an error the unfinished stage is left
    as it was (no "done" line)."""
    kind = display_kind() if enabled else "off"
    if kind == "off":
        yield None
        return
    display = _RichDisplay() if kind == "rich" else _PlainDisplay()
    ok = False
    try:
        yield display
        ok = True
    finally:
        display.close(ok)


progress_display = show_progress       # the name the CLI's commands use
