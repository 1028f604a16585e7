"""scripts/dev/with_progress.py, which make setup runs every pip install through: the command's output
passes through, a quiet command gets "still running" lines, and its exit code comes back."""

from __future__ import annotations

import sys

import pytest
from factories import load_script

pytestmark = pytest.mark.script


class Lines:
    """A stream that keeps the lines written to it and, at the first "still running" line, creates
    ``flag`` (the quiet child below waits for it: no timing decides the test)."""

    def __init__(self, flag):
        self.flag, self.text = flag, ""

    def write(self, s: str) -> None:
        self.text += s
        if "still running" in s:
            self.flag.touch()

    def flush(self) -> None:
        pass


def test_quiet_command_gets_still_running_lines_and_its_exit_code(tmp_path):
    mod = load_script("dev/with_progress.py")
    flag = tmp_path / "seen"
    child = ("import os, sys, time; print('first line', flush=True); "
             f"[time.sleep(0.02) for _ in iter(lambda: os.path.exists({str(flag)!r}), True)]; sys.exit(3)")
    out = Lines(flag)
    code = mod.run("setup: test", [sys.executable, "-c", child], every=0.05, out=out)
    lines = out.text.splitlines()
    assert code == 3
    assert lines[0].startswith("setup: test: ") and lines[0].endswith(" …")        # at once, with the command
    assert "first line" in lines and any(ln.startswith("setup: test: still running, ") for ln in lines)
    assert lines[-1].startswith("setup: test: failed (exit 3) in ")


def test_the_command_comes_after_a_double_dash(capsys):
    mod = load_script("dev/with_progress.py")
    with pytest.raises(SystemExit) as e:
        mod.main(["setup: x", "true"])
    assert e.value.code == 2 and "give the command after --" in capsys.readouterr().err
