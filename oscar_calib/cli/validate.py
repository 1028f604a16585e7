"""``oscar validate``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ._common import JsonOpt, TrustOpt, console, emit_json, stdout, table

EXAMPLES = """
    Examples:

    * `oscar validate runs/smollm2-135m`
    * `oscar validate zoo --allow-empty` (every artifact under zoo/; CI)
    * `oscar validate runs/qwen3-8b/oscar.safetensors --model Qwen/Qwen3-8B --json`
    """


def validate_command(
    paths: Annotated[list[Path], typer.Argument(help="Artifact directories, oscar.safetensors files, or directories "
                                                "holding artifact directories.")],
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Also check fingerprint and shapes against "
                                                 "this model (alias, directory, .gguf or hub id).")] = None,
    allow_empty: Annotated[bool, typer.Option(help="A directory without artifacts is not a problem.")] = False,
    trust_remote_code: TrustOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Check artifacts against the format-v1 contract: metadata, every shape, finite values,
    orthogonal rotations, clip ratios in (0, 1], descending eigenvalues, and with --model the
    fingerprint. Prints one line per problem; exit code 1 when there is any.
    """
    from ..tools.validate import model_reference, validate_paths

    ref = model_reference(model, trust_remote_code=trust_remote_code) if model else None
    reports = validate_paths(paths, model=ref, allow_empty=allow_empty)
    bad = [r for r in reports if not r.ok]
    if json_out:
        emit_json({"ok": not bad, "artifacts": [r.to_dict() for r in reports]})
    else:
        if reports:
            rows = [[str(r.path), r.metadata.get("model_id", "–"), r.metadata.get("num_layers", "–"),
                     r.metadata.get("granularity", "–"), "[green]ok[/green]" if r.ok else
                     f"[red]{len(r.problems)} problem(s)[/red]"] for r in reports]
            stdout.print(table("oscar validate", ["file", "model", "layers", "granularity", "result"], rows))
        else:
            console.print("no artifacts found")
        for r in bad:
            for p in r.problems:
                typer.echo(f"{r.path}: {p}", err=True)
    if bad:
        raise typer.Exit(1)


validate_command.__doc__ += EXAMPLES
