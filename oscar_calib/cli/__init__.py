"""The ``oscar`` command line. Commands live one group per module; each parses options, builds a
config, calls one library function and renders the result. Library errors (``OscarError``)
become one line on stderr and their exit code (2; 130 after Ctrl-C), an ``OSError`` from the
environment (a full disk, a vanished directory) one line and exit code 2, and library warnings
(``OscarWarning``) one line ``warning: ...``; ``OSCAR_DEBUG=1`` shows the traceback instead. A
command that succeeds ends with one line ``next: ...`` on stderr (``_common.next_step``)."""

from __future__ import annotations

import os
import sys
import warnings

import typer

from .. import __version__
from ..errors import OscarError, OscarWarning

ROOT_HELP = """OSCAR: offline calibration of covariance-aware rotations for a 2-bit KV cache.

A first run: `oscar calibrate --quick --out runs/first-try`. Each command ends with one line on
stderr, `next: ...`, saying what to run next; --json and OSCAR_PROGRESS=off leave it out.
"""

app = typer.Typer(
    name="oscar",
    help=ROOT_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"oscar {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """The root: ``--version``; its help is ``ROOT_HELP``."""


from .calibrate import calibrate_command  # noqa: E402

app.command("calibrate")(calibrate_command)
from .verify import verify_command  # noqa: E402

app.command("verify")(verify_command)
from .fold import fold_weights_command  # noqa: E402

app.command("fold-weights")(fold_weights_command)
from .interop import export_command, import_command  # noqa: E402
from .publish import pull_command, push_command  # noqa: E402
from .validate import validate_command  # noqa: E402
from .zoo import zoo_app  # noqa: E402

app.command("validate")(validate_command)
app.command("push")(push_command)
app.command("pull")(pull_command)
app.command("export")(export_command)
app.command("import")(import_command)
app.add_typer(zoo_app, name="zoo")
from .eval import eval_command  # noqa: E402

app.command("eval")(eval_command)


def _show_warning(message, category, filename, lineno, file=None, line=None, _default=warnings.showwarning):
    """``OscarWarning``: one line on stderr (in a job of several ranks, rank 0's, or the rank it names)."""
    if not issubclass(category, OscarWarning) or os.environ.get("OSCAR_DEBUG"):
        return _default(message, category, filename, lineno, file, line)
    text = str(message).replace("\n", " ")
    if os.environ.get("RANK", "0") == "0" or text.startswith("rank "):
        print(f"warning: {text}", file=sys.stderr, flush=True)


def main() -> None:
    warnings.showwarning = _show_warning
    # (idle OpenMP threads sleep instead of spinning: the package sets it on import, before torch)
    try:
        app()
    except OscarError as e:
        if os.environ.get("OSCAR_DEBUG"):
            raise
        msg = str(e).replace("\n", " ")
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(e.exit_code)
    except OSError as e:            # the environment refused a file operation the library did not expect to fail
        if os.environ.get("OSCAR_DEBUG"):
            raise
        where = f": {e.filename}" if e.filename else ""
        print(f"error: {e.strerror or e}{where} (OSCAR_DEBUG=1 shows where)", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
