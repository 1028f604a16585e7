"""Every command's --help reads whole at 80 columns: no line wider, no option name, type or default
cut short (rich's help panels end a cell that does not fit with "…")."""

from __future__ import annotations

import re

import click
import pytest
import typer
from typer.testing import CliRunner

from oscar_calib.cli import app

runner = CliRunner()
WIDTH = 80


def commands() -> list[tuple[list[str], click.Command]]:
    """(argv prefix, command) for the root, every command and every sub-command."""
    root = typer.main.get_command(app)
    out = [([], root)]
    for name, cmd in sorted(root.commands.items()):
        out.append(([name], cmd))
        for sub, subcmd in sorted((getattr(cmd, "commands", None) or {}).items()):
            out.append(([name, sub], subcmd))
    return out


def render(args: list[str], width: int = WIDTH) -> str:
    result = runner.invoke(app, [*args, "--help"], env={"COLUMNS": str(width)})
    assert result.exit_code == 0, result.output
    return result.output


def cells(text: str) -> str:
    """The help with the panels' borders removed and each wrapped cell joined: a word broken over
    two lines shows up as two words, which the checks below then miss."""
    return " ".join(line.strip(" │╭╮╰╯─") for line in text.splitlines())


def problems(args: list[str], cmd: click.Command, width: int = WIDTH) -> list[str]:
    """What is cut or too wide in ``args``' help at ``width`` columns."""
    text = render(args, width)
    out = [f"a line of {len(line)} columns" for line in text.splitlines() if len(line) > width]
    out += [f"cut: {line.strip()}" for line in text.splitlines() if "…" in line]
    words = set(re.split(r"[\s,]+", cells(text)))
    for param in cmd.params:
        if not isinstance(param, click.Option):
            continue
        out += [f"{name} is not whole" for name in [*param.opts, *param.secondary_opts] if name not in words]
        if param.show_default and param.default not in (None, False, "") and not param.is_flag:
            default = str(getattr(param.default, "value", param.default))
            if default not in words and f"{default}]" not in words:
                out.append(f"{param.opts[0]}: default {default!r} is cut")
    return out


@pytest.mark.parametrize("args,cmd", commands(), ids=lambda x: " ".join(x) if isinstance(x, list) else "")
def test_help_fits_80_columns_with_every_name_and_default_whole(args, cmd):
    found = problems(args, cmd)
    assert not found, f"oscar {' '.join(args)} --help at {WIDTH} columns: {found}\n{render(args)}"


def test_the_checks_can_fail():
    """Narrower than the help is laid out for, rich cuts names and defaults: the checks see it."""
    root = typer.main.get_command(app)
    found = problems(["validate"], root.commands["validate"], width=50)
    assert any("cut" in p or "not whole" in p for p in found), found
