"""Progress: the library reports every stage of a calibration and its verify; the CLI draws them as
plain lines off a terminal (a live bar on one), and leaves stdout to tables and JSON."""

from __future__ import annotations

import json
import time

from factories import oscar

from oscar_calib import display
from oscar_calib.cli import _progress
from oscar_calib.progress import counter, report, step

# (a quick run with its verify pass: the verify stages are drawn too)
FAST_ARGS = ["--tokens", "256", "--seq-len", "64", "--heldout-tokens", "32", "--device", "cpu"]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_plain_lines_only_for_slow_stages_throttled(monkeypatch, capsys):
    clock = Clock()
    monkeypatch.setattr(_progress.time, "monotonic", clock)
    d = _progress._PlainDisplay(interval=10, announce_after=2, ticker=False)
    tick = counter(d, "capture", 100, "tokens")
    for done, t in ((10, 1), (20, 5), (30, 12), (40, 15), (50, 23)):
        clock.t = 100 + t
        tick(done)
    clock.t = 130
    tick(100)
    with step(d, "rotations + clips"):                  # 1.5 s: below 2 s, no line at all
        clock.t = 131.5
    report(d, "loading model", 0, None)                 # no reports while it runs: the ticker speaks
    clock.t = 134
    d._tick(clock.t)
    d.close(ok=False)                                   # an error: no "done" line for the open stage
    assert capsys.readouterr().err.splitlines() == [
        "capture: 100 tokens …",                           # announced at 5 s (it has run 2 s by then)
        "capture: 40/100 tokens (40%), 15 s, about 22 s left",   # then at most one line every 10 s
        "capture: done in 30.0 s (100 tokens)",
        "loading model …",
    ]


def test_plain_ticker_runs_in_the_background(capsys):
    d = _progress._PlainDisplay(interval=10, announce_after=0.2)
    report(d, "loading model", 0, None)
    time.sleep(1.2)                                      # the ticker wakes every 0.5 s
    report(d, "loading model", 1, 1)
    d.close(ok=True)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "loading model …" and lines[1].startswith("loading model: done in ") and len(lines) == 2


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


def test_calibrate_shows_every_stage_and_keeps_stdout_clean(monkeypatch, tmp_path, tiny_llama_dir):
    monkeypatch.setattr(display, "ANNOUNCE_AFTER_S", 0.0)   # the tiny model's stages take milliseconds
    code, out, err = oscar("calibrate", tiny_llama_dir, "--out", tmp_path / "a", *FAST_ARGS, "--json",
                           env={"OSCAR_PROGRESS": "plain"})
    assert code in (0, 1), err                           # a random-init model may fail verify's comparison
    doc = json.loads(out)                                # stdout: the JSON document only
    assert doc["verify"]["passed"] in (True, False)
    done = [line.split(": done in ")[0] for line in err.splitlines() if ": done in " in line]
    # the data is read and tokenised before the weights load: a bad --data costs no model load
    stages = ["loading tokenizer", "tokenising data", "loading model", "capture", "held-out rows", "rotations + clips",
              "shared rotations", "verify: held-out pass", "verify: INT2 kernels"]
    assert done == ["starting", *stages], err          # (imports: shown, not a stage of the time line)
    # the JSON's time: every stage, and the rest as "other", adding up to the total in tenths
    t = doc["time"]
    assert [name for name, _ in t["stages"]] == stages and t["other_s"] >= 0
    assert sum(round(sec * 10) for _, sec in t["stages"]) + round(t["other_s"] * 10) == round(t["total_s"] * 10)
    assert "next:" not in err                        # --json: no advice on stderr


def test_stage_clock_accounts_for_every_second(monkeypatch):
    """Stages are timed whether a display draws them or not; the parts, each rounded to a tenth,
    add up to the total exactly, the untimed rest being "other"."""
    clock = Clock()
    drawn = []
    c = _progress.StageClock(clock=clock).wrap(lambda *a: drawn.append(a))
    clock.t = 101.26                                     # start-up before the first stage
    with step(c, "loading model"):
        clock.t = 104.31
    tick = counter(c, "capture", 2, "tokens")
    clock.t = 104.40
    tick(1)
    clock.t = 106.07
    tick(2)
    clock.t = 106.2                                      # writing files: between stages
    with step(c, "verify"):
        clock.t = 107.0
    with step(c, "loading model"):                       # a stage that comes back adds up
        clock.t = 107.04
    clock.t = 107.49
    parts, total = c.breakdown()
    assert dict(parts) == {"loading model": 3.1, "capture": 1.8, "verify": 0.8, "other": 1.8} and total == 7.5
    assert c.line() == "time: loading model 3.1 s, capture 1.8 s, verify 0.8 s, other 1.8 s; total 7.5 s"
    assert c.to_dict() == {"total_s": 7.5, "stages": [["loading model", 3.1], ["capture", 1.8], ["verify", 0.8]],
                           "other_s": 1.8}
    assert drawn[0] == ("loading model", 0, None, "") and len(drawn) == 9     # every report passed on
