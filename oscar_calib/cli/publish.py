"""``oscar push`` and ``oscar pull``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..progress import step
from ._common import JsonOpt, console, emit_json, stdout, table
from ._progress import progress_display

PUSH_EXAMPLES = """
    Examples:

    * `oscar push runs/qwen3-8b --to hf:my-org/qwen3-8b-oscar --dry-run`
    * `oscar push runs/qwen3-8b --to hf:my-org/qwen3-8b-oscar --private --revision v1`
    * `MODELSCOPE_API_TOKEN=... oscar push runs/qwen3-8b --to modelscope:my-org/qwen3-8b-oscar`
    """

PULL_EXAMPLES = """
    Examples:

    * `oscar pull hf:my-org/qwen3-8b-oscar` (into $OSCAR_CACHE/zoo/hf/my-org/qwen3-8b-oscar)
    * `oscar pull modelscope:my-org/qwen3-8b-oscar --revision v1 --out rotations/qwen3-8b`
    """


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def push_command(
    artifact: Annotated[Path, typer.Argument(help="Artifact directory.")],
    to: Annotated[str, typer.Option("--to", help="Target: hf:ORG/NAME or modelscope:ORG/NAME.")],
    private: Annotated[bool, typer.Option(help="Create the repository private.")] = False,
    revision: Annotated[Optional[str], typer.Option("--revision", "--branch", help="Branch to push to "
                                                    "(created if needed; default: main/master).")] = None,
    commit_message: Annotated[Optional[str], typer.Option(help="Commit message (default: names model and "
                                                          "method).")] = None,
    force: Annotated[bool, typer.Option(help="Push even without a passing verify.json (never an invalid "
                                        "artifact).")] = False,
    dry_run: Annotated[bool, typer.Option(help="Validate and list files, sizes and target; touch no network.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Validate ARTIFACT and upload it, model card included, to the Hugging Face hub or ModelScope.

    Refuses an invalid artifact, and an unverified one (no verify.json with "passed": true from
    `oscar verify`) unless --force. Tokens: HF_TOKEN or `hf auth login`; MODELSCOPE_API_TOKEN or
    `modelscope login`.
    """
    from ..tools.publish import parse_target, plan_push, push

    plan = plan_push(artifact, parse_target(to), revision=revision, private=private,
                     commit_message=commit_message, force=force)
    if not plan.verified:
        console.print("[yellow]warning: artifact is not verified; continuing because of --force[/yellow]")
    if dry_run:
        if json_out:
            emit_json(plan.to_dict() | {"dry_run": True})
            return
        rows = [[name, size, _size(size)] for name, size in plan.files]
        rows.append(["total", plan.total_bytes, _size(plan.total_bytes)])
        stdout.print(table(f"dry run: files of {plan.folder}", ["file", "bytes", "size"], rows))
        stdout.print(f"target:   {plan.target} -> {plan.target.url}\n"
                     f"repo:     {'private' if plan.private else 'public'} model repository (created if missing)\n"
                     f"revision: {plan.revision or 'default branch'}\n"
                     f"commit:   {plan.commit_message}\n"
                     f"verified: {'yes' if plan.verified else 'no (--force)'}\n"
                     "dry run: nothing was uploaded", highlight=False)
        return
    with progress_display() as progress, step(progress, f"uploading to {plan.target}"):
        url = push(plan)
    if json_out:
        emit_json(plan.to_dict() | {"dry_run": False, "url": url})
        return
    stdout.print(f"pushed {len(plan.files)} files ({_size(plan.total_bytes)}) to {url}")


def pull_command(
    source: Annotated[str, typer.Argument(help="hf:ORG/NAME or modelscope:ORG/NAME.")],
    revision: Annotated[Optional[str], typer.Option(help="Branch, tag or commit (default: the default "
                                                    "branch).")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Directory to place the artifact in "
                                                "(default: the zoo cache).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace the contents of a non-empty --out.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Download an artifact into the local zoo cache (`$OSCAR_CACHE/zoo/HUB/ORG/NAME`) or --out,
    validate it, and move it into place only when it is valid.
    """
    from ..tools.publish import pull

    with progress_display() as progress, step(progress, f"downloading {source}"):
        result = pull(source, revision=revision, out=out, overwrite=overwrite)
    if json_out:
        emit_json(result.to_dict())
        return
    md = result.report.metadata
    stdout.print(f"pulled {result.target} ({md.get('model_id')}, {md.get('num_layers')} layers, "
                 f"{md.get('granularity')} granularity) into {result.path}; valid")


push_command.__doc__ += PUSH_EXAMPLES
pull_command.__doc__ += PULL_EXAMPLES
