"""Shared CLI pieces: option aliases, the console, and one output helper for tables and --json."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from ..display import console  # noqa: F401  (progress, tables and messages for people, on stderr)

stdout = Console(width=None if sys.stdout.isatty() else 140)   # tables when no --json

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout instead of tables.")]
ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Model: alias (smollm2-135m, gemma3-270m), checkpoint "
                                        "directory, .gguf file, or hub id.")]
DtypeOpt = Annotated[str, typer.Option(help="Weights dtype: auto (as stored; GGUF -> float32), float32, bfloat16, float16.")]
DeviceOpt = Annotated[str, typer.Option(help="Device: auto (cuda if available), cpu, cuda, cuda:N.")]
TrustOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Allow a hub model's own Python code to run.")]
DeviceMapOpt = Annotated[Optional[str], typer.Option(help="Spread a model too big for one device with accelerate: "
                                                     "auto, balanced, sequential, cpu, cuda:N or a JSON map.")]
MaxMemoryOpt = Annotated[Optional[str], typer.Option(help="Memory per device for --device-map, e.g. "
                                                     "0=70GiB,1=70GiB,cpu=200GiB (the rest is offloaded to disk).")]
OffloadDirOpt = Annotated[Optional[Path], typer.Option(help="Folder for weights offloaded to disk with --device-map "
                                                       "(safetensors checkpoints are read in place without it).")]


def next_step(text: str, *, json_out: bool = False) -> None:
    """The one line that ends a command for people: ``next: ...``, what to run next (stderr, never
    wrapped). Left out with ``--json`` (a program reads stdout and needs no advice) and when
    ``OSCAR_PROGRESS=off`` (quiet stderr)."""
    if json_out or os.environ.get("OSCAR_PROGRESS", "").strip().lower() == "off":
        return
    console.print(f"next: {text}", markup=False, highlight=False, soft_wrap=True)


# About how long a command that a `next:` line proposes runs, with its defaults, on a 2-core CPU
# machine for the pip-shipped models, model load included (scripts/bench/bench_first_run.py: demo,
# eval; the fresh-clone runs in CHANGELOG.md). Another model: its size decides, so the line says so.
CPU_TIMES = {
    ("verify", "smollm2-135m"): "about 1 min",
    ("verify", "gemma3-270m"): "a few minutes",
    ("eval", "smollm2-135m"): "about 1 min",
    ("eval", "gemma3-270m"): "a few minutes",
    ("calibrate", "smollm2-135m"): "about 1 min",
}
SLOW_COMMANDS = {"verify", "eval", "calibrate", "fold-weights"}     # they load and run the model


def takes(command: str, model: str) -> str:
    """`` (about N min on 2 CPU cores)`` for a `next:` line proposing ``oscar COMMAND MODEL ...``;
    for a model not in :data:`CPU_TIMES`, the scale of it (minutes on a CPU for a small model).
    Empty for a command that does not run a model."""
    if command not in SLOW_COMMANDS:
        return ""
    known = CPU_TIMES.get((command, model))
    return f" ({known} on 2 CPU cores)" if known else " (minutes on a CPU for a model of 100M parameters)"


def model_of_artifact(metadata: dict) -> str:
    """The MODEL argument `oscar verify` would load for an artifact (its model_id when that cannot
    be told without the model's files)."""
    from ..errors import OscarError
    from ..model.source import model_for_artifact

    try:
        return model_for_artifact(metadata)
    except OscarError:
        return metadata.get("model_id", "")


def more_data_hint(model: str, out: Path) -> str:
    """The `next:` line after a failed verification: calibrate again on four times the default
    text, into ``out`` (a zoo entry, committed: into runs/ instead)."""
    from ..contract.config import CalibrationConfig
    from ..tools.zoo import zoo_of

    again = Path("runs") / Path(out).name if zoo_of(out) is not None else out
    return (f"see the reasons above; more calibration text often helps: oscar calibrate {quote(model)} --tokens "
            f"{4 * CalibrationConfig.tokens} --out {quote(again)} --overwrite (four times the text of a default run, "
            "about four times its time)")


def quote(value) -> str:
    """A path or name as a shell word, for a command line a person copies."""
    return shlex.quote(str(value))


def emit_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def table(title: str, columns: list[str], rows: list[list], *, caption: str | None = None) -> Table:
    t = Table(title=title, caption=caption, show_lines=False)
    for c in columns:
        t.add_column(c, justify="right" if c not in ("layer type", "attention", "file", "check", "key") else "left")
    for r in rows:
        t.add_row(*[str(x) for x in r])
    return t


def fmt(x, digits: int = 4) -> str:
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)
