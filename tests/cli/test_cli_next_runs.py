"""Following the `next:` lines is safe: every `oscar ...` command a next: line proposes that the CPU
can run is run here, in a copy of the repository's zoo, and so are the commands their own next:
lines propose, until none is new. Afterwards the zoo is byte for byte what it was and passes the
checks `make test` runs on it (`oscar validate zoo` with the index), and every file the commands
wrote outside it is one git ignores: following a hint never leaves a state that fails `make test`.

What a command writes does not depend on how much it measures, so the commands that run a model
take the smallest measurement options (``CHEAP``); the real SmolLM2 comes from the session's
fixture (loaded once), and the calibration chain runs on a tiny checkpoint."""

from __future__ import annotations

import hashlib
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import typer.main
from factories import FAST_ARGS, REPO, oscar

from oscar_calib.cli import app
from oscar_calib.tools.validate_ci import check_index

NEEDS_NETWORK = {"push", "pull"}                # a hub: never run here
# the smallest measurement of each command that runs a model (appended to the hint's own words)
CHEAP = {"verify": ["--depths", "64", "--sequences", "1", "--positions", "2", "--backend", "torch",
                    "--device", "cpu"],
         "eval": ["--methods", "bf16,oscar", "--seq-len", "96", "--sink", "8", "--recent", "8", "--device", "cpu"],
         "calibrate": FAST_ARGS}


def hint_commands(err: str) -> list[list[str]]:
    """The `oscar ...` commands of the next: lines in ``err``, as argument lists without ``oscar``:
    each command's words are read with its own parameters (an option's value, as many positional
    arguments as it takes); the prose around them is left out."""
    cli = typer.main.get_command(app)
    found = []
    for line in err.splitlines():
        if not line.startswith("next: "):
            continue
        # shell words as `quote` writes them ('...' around a path with spaces); an apostrophe
        # inside a word of prose ("the zoo's index") is no quote
        words = [re.sub(r"^'(.*)'([;,]?)$", r"\1\2", w)
                 for w in re.findall(r"'[^']*'[;,]?|\S+", line[len("next: "):].replace("(", " ( "))]
        for i, w in enumerate(words):
            if w == "oscar" and i + 1 < len(words) and words[i + 1].rstrip(";,") in cli.commands:
                found.append(_command(words[i + 1:], cli))
    return found


def _command(words: list[str], cli) -> list[str]:
    name = words[0].rstrip(";,")
    cmd = cli.commands[name]
    options = {o: p for p in cmd.params if p.param_type_name == "option" for o in (*p.opts, *p.secondary_opts)}
    slots = [p for p in cmd.params if p.param_type_name == "argument"]
    out, it = [name], iter(words[1:])
    for w in it:
        word = w.rstrip(";,")
        if word in options:
            out.append(word)
            if not options[word].is_flag:
                out.append(next(it).rstrip(";,"))
        elif slots and word and not word.startswith("("):
            slots.pop(0)
            out.append(word)
        else:
            break
        if word != w:                        # "...;" or "...," ends the command
            break
    return out


def test_hint_commands_are_read_with_each_commands_parameters():
    err = ("next: oscar eval smollm2-135m runs/a measures perplexity (about 1 min); oscar export runs/a --out "
           "serve/a prepares serving\n"
           "next: oscar calibrate m --tokens 32768 --out 'runs/my run' --overwrite (4x); the zoo's card\n"
           "other: oscar verify x")
    assert hint_commands(err) == [["eval", "smollm2-135m", "runs/a"], ["export", "runs/a", "--out", "serve/a"],
                                  ["calibrate", "m", "--tokens", "32768", "--out", "runs/my run", "--overwrite"]]


def _tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _ignored_by_git(paths: list[str]) -> list[str]:
    """Which of ``paths`` (relative to the repository root) the repository's .gitignore ignores."""
    if not paths:
        return []
    proc = subprocess.run(["git", "-C", str(REPO), "check-ignore", "--no-index", "--stdin"], input="\n".join(paths),
                          capture_output=True, text=True, check=False)
    if proc.returncode not in (0, 1):
        pytest.skip(f"git check-ignore is not available here: {proc.stderr.strip()}")
    return proc.stdout.split()


def follow(start: list[list[str]], runnable, limit: int = 12) -> list[tuple[list[str], int]]:
    """Run ``start``, then every new command their next: lines propose that ``runnable`` accepts,
    breadth first; returns (command, exit code) of each."""
    queue, seen, ran = list(start), set(), []
    while queue and len(ran) < limit:
        args = queue.pop(0)
        key = tuple(args)
        if key in seen or not runnable(args):
            continue
        seen.add(key)
        code, _, err = oscar(*args, *CHEAP.get(args[0], []), env={"OSCAR_PROGRESS": "plain"})
        assert code == 0 or args[0] == "verify" and code == 1, f"oscar {shlex.join(args)}: exit {code}\n{err}"
        ran.append((args, code))
        queue += hint_commands(err)
    return ran


@pytest.fixture
def clone(tmp_path, monkeypatch) -> Path:
    """A copy of the repository's zoo in a fresh working directory (the hints' relative paths land there)."""
    shutil.copytree(REPO / "zoo", tmp_path / "zoo")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _assert_clean(clone: Path, before: dict[str, str]) -> None:
    assert _tree(clone / "zoo") == before, "a hint changed the committed zoo"
    assert oscar("validate", "zoo").exit_code == 0
    report = check_index(clone / "zoo" / "index.json")
    assert report.ok, report.problems
    written = [p for p in _tree(clone) if not p.startswith("zoo/")]
    assert sorted(_ignored_by_git(written)) == sorted(written), "a hint wrote a file git would commit"


def test_validate_and_export_hints_need_no_model(clone):
    """validate's and export's next: lines, followed as far as no model is needed."""
    before = _tree(clone / "zoo")
    start = [["validate", "zoo"], ["validate", "zoo/smollm2-135m"],
             ["export", "zoo/smollm2-135m", "--out", "serve/smollm2-135m"]]
    ran = follow(start, lambda a: a[0] in ("validate", "export", "zoo"))
    assert [a for a, _ in ran][:3] == start
    _assert_clean(clone, before)


@pytest.mark.slow
def test_every_hint_from_the_zoo_and_a_calibration(clone, monkeypatch, smollm2_loaded, tiny_llama_dir):
    """From `oscar validate zoo` (verify of the SmolLM2 entry, then eval, export) and from a
    calibration (eval, export, push's dry run is not followed: it names a hub)."""
    import oscar_calib.model.load as load

    real = load.load_model
    monkeypatch.setattr(load, "load_model", lambda spec, **kw: smollm2_loaded if spec == "smollm2-135m"
                        else real(spec, **kw))
    before = _tree(clone / "zoo")
    ran = follow([["validate", "zoo"], ["calibrate", str(tiny_llama_dir), "--out", "runs/tiny"]],
                 lambda a: a[0] not in NEEDS_NETWORK)
    commands = [a[0] for a, _ in ran]
    assert {"verify", "eval", "export", "calibrate"} <= set(commands), commands
    assert ["verify", "zoo/smollm2-135m"] in [a for a, _ in ran]
    _assert_clean(clone, before)

    # told to (--record), verify and eval write into a zoo entry, and refresh the zoo's index with it
    shutil.copytree(clone / "runs" / "tiny", clone / "zoo" / "tiny")
    for name in ("verify.json", "verify.png"):                  # an entry not verified yet
        (clone / "zoo" / "tiny" / name).unlink(missing_ok=True)
    assert oscar("zoo", "index", "--zoo", "zoo").exit_code == 0
    code, out, err = oscar("verify", "zoo/tiny", "--record", *CHEAP["verify"])
    assert code in (0, 1) and "recorded in zoo/tiny/verify.json and verify.png; zoo/index.json refreshed" in out, err
    code, out, err = oscar("eval", str(tiny_llama_dir), "zoo/tiny", "--record", *CHEAP["eval"])
    assert code == 0 and "zoo/index.json refreshed" in " ".join(out.split()), err
    assert (clone / "zoo" / "tiny" / "verify.json").is_file() and check_index(clone / "zoo" / "index.json").ok
