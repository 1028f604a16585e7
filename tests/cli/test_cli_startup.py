"""Light commands import nothing heavy: ``--help`` of every command, ``zoo``, ``validate`` without
``--model`` and ``export`` (torch only: it writes torch pickles). One fresh interpreter imports the
CLI (``oscar_calib.cli``, what the console script imports before it parses anything), then runs
each command in a child forked from it, which reports the heavy modules in its ``sys.modules``: a
child starts with exactly the modules a fresh ``oscar`` process has when it reaches ``main()``,
without paying the interpreter's start-up once per command. The start-up times themselves are
measured by ``scripts/bench/bench_first_run.py --parts startup``, not asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from factories import make_artifact

from oscar_calib.cli import app

HEAVY = ("torch", "transformers", "triton", "accelerate", "datasets", "matplotlib", "huggingface_hub", "modelscope",
         "gguf", "safetensors.torch")
REPO = Path(__file__).resolve().parents[2]

PROBE = """
import json, os, sys
commands, watch, blocked = json.loads(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
for name in blocked:
    sys.modules[name] = None                       # as on an install without it: importing it fails
from oscar_calib.cli import main
for args in commands:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # the child: one `oscar ARGS`
        os.close(read)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        sys.argv = ["oscar", *args]
        code = 0
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            code = "exception"
        heavy = sorted(m for m in watch if sys.modules.get(m) is not None)
        os.write(write, json.dumps({"code": code, "heavy": heavy}).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        report = f.read()
    os.waitpid(pid, 0)
    print("PROBE " + (report.decode() or json.dumps({"code": "no report", "heavy": []})))
"""


def probe_all(commands: list[list[str]], env: dict, blocked: tuple[str, ...] = ()) -> list[dict]:
    """``{"code": exit code, "heavy": heavy modules loaded}`` of each ``oscar ARGS`` in ``commands``
    (``blocked`` modules made unimportable first)."""
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(commands), json.dumps(HEAVY), json.dumps(blocked)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    reports = [json.loads(line[len("PROBE "):]) for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert proc.returncode == 0 and len(reports) == len(commands), proc.stdout[-2000:] + proc.stderr[-2000:]
    return reports


def probe(args: list[str], env: dict, blocked: tuple[str, ...] = ()) -> dict:
    return probe_all([args], env, blocked)[0]


def every_help() -> list[list[str]]:
    """``--help`` of the root, of every command and of every sub-command, from the CLI itself."""
    root = typer.main.get_command(app)
    out = [["--help"], ["--version"]]
    for name, cmd in sorted(root.commands.items()):
        out.append([name, "--help"])
        for sub in sorted(getattr(cmd, "commands", {}) or {}):
            out.append([name, sub, "--help"])
    return out


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    root = tmp_path_factory.mktemp("startup")
    zoo = root / "zoo"
    make_artifact(zoo / "a", granularity="layer", metadata={"fork_k_clip": "0.96", "fork_v_clip": "0.92"})
    make_artifact(zoo / "b", seed=1)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OSCAR_CACHE": str(root / "cache"), "OSCAR_ZOO": str(zoo)}
    return zoo, root, env


def light_commands(zoo: Path, root: Path) -> list[list[str]]:
    return every_help() + [
        ["zoo", "index"], ["zoo", "index", "--check"], ["zoo", "list"], ["zoo", "list", "--json"], ["zoo", "table"],
        ["validate", str(zoo)], ["validate", str(zoo), "--format", "github"], ["validate", str(zoo / "a"), "--json"],
        ["validate", str(root / "missing")],                           # a bad path: one line, still light
    ]


def test_every_command_is_covered():
    """A new command gets its --help probed without anyone remembering to add it."""
    names = {args[0] for args in every_help() if len(args) > 1}
    assert {"calibrate", "verify", "eval", "fold-weights", "validate", "zoo", "export", "import", "push",
            "pull"} <= names


def test_light_commands_import_nothing_heavy(setting):
    zoo, root, env = setting
    failures = []
    commands = light_commands(zoo, root)
    for args, r in zip(commands, probe_all(commands, env)):
        if r["heavy"]:
            failures.append((args, r["heavy"]))
        expected = 2 if args[:2] == ["validate", str(root / "missing")] else 0      # nothing to validate: exit 2
        assert r["code"] == expected, (args, r)
    assert not failures, failures


def test_validate_runs_where_torch_and_triton_cannot_import(setting):
    """triton is a Linux-only requirement (no wheels elsewhere): `oscar validate` and `oscar zoo` work
    on an install where neither it nor torch imports, with the same results."""
    zoo, root, env = setting
    commands = [["validate", str(zoo)], ["validate", str(zoo / "a"), "--json"], ["zoo", "list"],
                ["validate", str(root / "missing")]]
    reports = probe_all(commands, env, blocked=("torch", "triton"))
    for args, r in zip(commands, reports):
        assert r == {"code": 2 if "missing" in args[-1] else 0, "heavy": []}, (args, r)


def test_export_needs_torch_but_not_transformers(setting, tmp_path):
    """export writes the fork's torch pickles and checks them with torch.load: torch, nothing more."""
    zoo, _, env = setting
    r = probe(["export", str(zoo / "a"), "--out", str(tmp_path / "serve")], env)
    assert r["code"] == 0 and (tmp_path / "serve" / "launch.sh").exists()
    assert "torch" in r["heavy"] and "transformers" not in r["heavy"] and "triton" not in r["heavy"], r


def test_a_heavy_command_is_seen_as_heavy(setting, tmp_path):
    """The probe can fail: checking against a model reads its config through transformers."""
    zoo, _, env = setting
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    r = probe(["validate", str(zoo / "a"), "--model", str(tmp_path / "gpt2")], env)
    assert r["code"] == 2 and "transformers" in r["heavy"], r
