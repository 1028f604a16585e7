"""Progress: the library reports every stage of a calibration and its verify; the CLI draws them as
plain lines off a terminal (a live bar on one), and leaves stdout to tables and JSON."""

from __future__ import annotations

import json
import sys

from oscar_calib.cli import _progress, main
from oscar_calib.progress import counter, report, step

FAST_ARGS = ["--tokens", "256", "--seq-len", "64", "--heldout-tokens", "32", "--device", "cpu"]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_plain_lines_start_throttle_and_finish(monkeypatch, capsys):
    clock = Clock()
    monkeypatch.setattr(_progress.time, "monotonic", clock)
    d = _progress._PlainDisplay(interval=10)
    tick = counter(d, "capture", 100, "tokens")
    for done, t in ((10, 1), (20, 5), (30, 12), (40, 15), (50, 23)):
        clock.t = 100 + t
        tick(done)
    clock.t = 130
    tick(100)
    with step(d, "rotations + clips"):
        clock.t = 131.5
    report(d, "verify", 0, None)
    d.close(ok=False)                                   # an error: no "done" line for the open stage
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "capture: 100 tokens …",
        "capture: 30/100 tokens (30%), 12 s, about 28 s left",   # first line after 10 s, then every 10 s
        "capture: 50/100 tokens (50%), 23 s, about 23 s left",
        "capture: done in 30.0 s (100 tokens)",
        "rotations + clips …",
        "rotations + clips: done in 1.5 s",
        "verify …",
    ]


def test_off_and_rich_are_chosen_by_environment(monkeypatch):
    monkeypatch.setenv("OSCAR_PROGRESS", "off")
    with _progress.progress_display() as p:
        assert p is None
    monkeypatch.setenv("OSCAR_PROGRESS", "rich")
    with _progress.progress_display() as p:
        assert isinstance(p, _progress._RichDisplay)
        counter(p, "capture", 4, "tokens")(2)
        step_task = p.bar.tasks[p.tasks["capture"]]
        assert step_task.completed == 2 and step_task.total == 4
        report(p, "verify", 0, None)                     # a new stage finishes the previous one
        assert step_task.finished
    monkeypatch.delenv("OSCAR_PROGRESS")
    assert _progress.display_kind() == "plain"           # pytest's stderr is not a terminal


def test_calibrate_shows_every_stage_and_keeps_stdout_clean(monkeypatch, capsys, tmp_path, tiny_llama_dir):
    monkeypatch.setenv("OSCAR_PROGRESS", "plain")
    monkeypatch.setattr(sys, "argv", ["oscar", "calibrate", str(tiny_llama_dir), "--out", str(tmp_path / "a"),
                                      *FAST_ARGS, "--json"])
    try:
        main()
    except SystemExit as e:
        assert e.code in (0, 1)                          # a random-init model may fail verify's comparison
    cap = capsys.readouterr()
    doc = json.loads(cap.out)                            # stdout: the JSON document only
    assert doc["verify"]["passed"] in (True, False)
    done = [line.split(": done in ")[0] for line in cap.err.splitlines() if ": done in " in line]
    assert done == ["loading model", "tokenising data", "capture", "held-out rows", "rotations + clips",
                    "shared rotations", "verify: held-out pass", "verify: INT2 kernels"], cap.err
