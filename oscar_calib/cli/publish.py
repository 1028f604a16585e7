"""``oscar push`` and ``oscar pull``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..progress import step
from ._common import (
    JsonOpt,
    console,
    emit_json,
    model_of_artifact,
    next_step,
    quote,
    stdout,
    table,
    takes,
)
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
    * `oscar pull rotationzoo:qwen3-8b` (OSCAR's own rotations from hf:Zhongzhu/OSCAR-RotationZoo)
    * `oscar pull rotationzoo:qwen3-4b-thinking-2507 --tag seq20000_prompt85_group128 --model Qwen/Qwen3-4B-Thinking-2507`
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
    private: Annotated[bool, typer.Option("--private", help="Create the repository private.")] = False,
    revision: Annotated[Optional[str], typer.Option("--revision", "--branch", help="Branch to push to "
                                                    "(created if needed; default: main/master).")] = None,
    commit_message: Annotated[Optional[str], typer.Option(help="Commit message (default: names model and "
                                                          "method).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Push even when verify.json is missing, failed or stale "
                                        "(it verified other content). Never an invalid artifact, nor one "
                                        "without a digest.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate and list files, sizes and target; touch no "
                                          "network.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Validate ARTIFACT and upload it, model card included, to the Hugging Face hub or ModelScope.

    Refuses an invalid artifact and one without a content digest (`oscar validate --fix-digest`
    adds it). Refuses, unless --force, an artifact not verified on its current content: no
    verify.json with "passed": true from `oscar verify`, or a stale one (it recorded another
    content digest: the artifact changed after it was verified). Tokens: HF_TOKEN or
    `hf auth login`; MODELSCOPE_API_TOKEN or `modelscope login`.
    """
    from ..tools.publish import parse_target, plan_push, push

    plan = plan_push(artifact, parse_target(to), revision=revision, private=private,
                     commit_message=commit_message, force=force)
    if not plan.verified:
        console.print(f"warning: --force skips the verification gate: {plan.verification.why}; the artifact was "
                      "validated and carries its digest, but no passing verify.json vouches for this content", style="yellow",
                      highlight=False, markup=False)
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
                     f"digest:   {plan.content_sha256}\n"
                     f"verified: {'yes' if plan.verified else plan.verification.state + ' (--force)'}\n"
                     "dry run: nothing was uploaded", highlight=False)
        next_step(f"the same command without --dry-run uploads {len(plan.files)} files to {plan.target}")
        return
    with progress_display() as progress, step(progress, f"uploading to {plan.target}"):
        url = push(plan)
    if json_out:
        emit_json(plan.to_dict() | {"dry_run": False, "url": url})
        return
    stdout.print(f"pushed {len(plan.files)} files ({_size(plan.total_bytes)}) to {url}")
    next_step(f"anyone gets it with oscar pull {plan.target}{' --revision ' + quote(plan.revision) if plan.revision else ''}")


def pull_command(
    source: Annotated[str, typer.Argument(help="hf:ORG/NAME, modelscope:ORG/NAME, or rotationzoo:MODEL (OSCAR's own "
                                        "rotations; MODEL a configs/ name or model id).")],
    revision: Annotated[Optional[str], typer.Option(help="Branch, tag or commit (default: the default "
                                                    "branch).")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Directory to place the artifact in "
                                                "(default: the zoo cache).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace the contents of a non-empty --out.")] = False,
    tag: Annotated[Optional[str], typer.Option(help="rotationzoo: the calibration tag (`seq<T>_prompt<N>_group<G>`) "
                                               "or directory to take (default: the config's, else the only one).")]
    = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="rotationzoo: the model the artifact is for "
                                                 "(its config.json gives the fingerprint; default: configs/ "
                                                 "geometry).")] = None,
    clip: Annotated[Optional[str], typer.Option(help="rotationzoo: clip ratios k=..,v=.. (default: the config's, the "
                                                "fork's scripts).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Download an artifact into the local zoo cache (`$OSCAR_CACHE/zoo/HUB/ORG/NAME`) or --out,
    validate it, and move it into place only when it is valid.

    `rotationzoo:MODEL` fetches OSCAR's own K/V rotation files for MODEL from the Hugging Face repo
    Zhongzhu/OSCAR-RotationZoo (found by listing it: a directory named after the model holding
    `k_rotation_*.pt` and `v_rotation_*.pt`) and imports them as a validated artifact into
    `$OSCAR_CACHE/zoo/rotationzoo/MODEL` or --out, with the clips, group size and windows of
    MODEL's configs/ file, recording the repository, files and calibration tag in the card.
    """
    if source.startswith("rotationzoo:"):
        return _pull_rotationzoo(source, revision, out, overwrite, tag, model, clip, json_out)
    from ..errors import InputError
    from ..tools.publish import pull

    if tag or model or clip:
        raise InputError("--tag, --model and --clip apply to rotationzoo:MODEL sources only")
    with progress_display() as progress, step(progress, f"downloading {source}"):
        result = pull(source, revision=revision, out=out, overwrite=overwrite)
    if json_out:
        emit_json(result.to_dict())
        return
    md = result.report.metadata
    stdout.print(f"pulled {result.target} ({md.get('model_id')}, {md.get('num_layers')} layers, "
                 f"{md.get('granularity')} granularity) into {result.path}; valid")
    next_step(_verify_next(result.path))


push_command.__doc__ += PUSH_EXAMPLES
pull_command.__doc__ += PULL_EXAMPLES


def _pull_rotationzoo(source, revision, out, overwrite, tag, model, clip, json_out) -> None:
    from ..contract.config import parse_clip
    from ..tools.rotationzoo import pull_rotationzoo

    with console.status(f"pulling {source} …"):
        pulled = pull_rotationzoo(source, out=out, tag=tag, model=model, revision=revision, clip=parse_clip(clip),
                                  overwrite=overwrite)
    if json_out:
        emit_json(pulled.to_dict())
        return
    s = pulled.source
    stdout.print(f"pulled {source}: {s['repository']} {s['directory']} (tag {s['calibration_tag']}), clips "
                 f"{s['clips']}; imported into {pulled.out}; valid", highlight=False)
    next_step(_verify_next(pulled.out))


def _verify_next(path: Path) -> str:
    from ..contract.artifact import read_metadata

    model = model_of_artifact(read_metadata(Path(path)))
    return (f"oscar verify {quote(path)} measures it on its model with the INT2 kernels{takes('verify', model)} "
            "(--model if not its own)")
