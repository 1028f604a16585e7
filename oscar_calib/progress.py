"""Progress reports from long library calls: the library reports, the CLI draws.

A function that can run for more than a second or two takes ``progress: ProgressFn | None`` and
calls it as ``progress(stage, done, total, unit)``:

=========  ==========================================================================
argument   meaning
=========  ==========================================================================
``stage``  what runs now, a short label shown to people ("loading model", "capture")
``done``   units finished so far: 0 when the stage starts
``total``  units in the stage, or ``None`` when unknown (a spinner, not a bar)
``unit``   what is counted ("tokens", "layers", ...), ``""`` for nothing in particular
=========  ==========================================================================

A stage ends when ``done`` reaches ``total`` or another stage starts. A stage of unknown length
reports ``(stage, 0, None)`` when it starts and ``(stage, 1, 1)`` when it ends: :func:`step` does
both around a block. ``None`` means nobody is listening. The library never draws anything
itself: the caller renders these reports, the ``oscar`` command and scripts alike with
:func:`oscar_calib.display.show_progress` (a live bar on a terminal, plain periodic lines
otherwise).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Optional

ProgressFn = Callable[[str, int, Optional[int], str], None]


def report(progress: ProgressFn | None, stage: str, done: int, total: int | None = None, unit: str = "") -> None:
    """Send one report, or nothing when ``progress`` is None."""
    if progress is not None:
        progress(stage, done, total, unit)


@contextmanager
def step(progress: ProgressFn | None, stage: str) -> Iterator[None]:
    """A stage of unknown length around a block: started on entry, finished on a normal exit
    (on an exception the display is closed by its owner instead)."""
    report(progress, stage, 0, None)
    yield
    report(progress, stage, 1, 1)


def counter(progress: ProgressFn | None, stage: str, total: int, unit: str = "") -> Callable[[int], None]:
    """``tick(done)`` reporting ``(stage, done, total, unit)``; reports 0 at once."""
    report(progress, stage, 0, total, unit)
    return lambda done: report(progress, stage, done, total, unit)
