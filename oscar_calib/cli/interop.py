"""``oscar export`` and ``oscar import``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ._common import JsonOpt, ModelOpt, TrustOpt, emit_json, stdout

EXPORT_EXAMPLES = """
    Examples:

    * `oscar export runs/qwen3-8b --format sglang --out serve/qwen3-8b`
    """

IMPORT_EXAMPLES = """
    Examples:

    * `oscar import k_rotations.pt v_rotations.pt --model Qwen/Qwen3-8B --out runs/qwen3-8b-imported`
    * `oscar import K.pt V.pt --model smollm2-135m --out runs/imported --clip k=0.95,v=0.9`
    """

FORMATS = ("sglang",)


def export_command(
    artifact: Annotated[Path, typer.Argument(help="Artifact directory.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for the exported files.")],
    fmt_name: Annotated[str, typer.Option("--format", help="Target format: sglang (the OSCAR SGLang "
                                          "fork).")] = "sglang",
    overwrite: Annotated[bool, typer.Option(help="Replace files already in --out.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Export ARTIFACT for serving: k_rotations.pt and v_rotations.pt in the OSCAR SGLang fork's
    format (format_version 1 for per-layer artifacts, 2 for per-KV-head), clips.json, and serve.env
    with the serving settings (clip ratios, sink/recent tokens, group size, whether V is folded).
    """
    from ..numerics.rotation import choose
    from ..tools.sglang import export_sglang

    choose("--format", fmt_name, FORMATS)
    result = export_sglang(artifact, out, overwrite=overwrite)
    if json_out:
        emit_json(result.to_dict())
        return
    stdout.print(f"exported {artifact} for the OSCAR SGLang fork (rotation format_version "
                 f"{result.format_version}) into {result.out}:")
    for f in result.files:
        stdout.print(f"  {result.out / f}")
    stdout.print(f"serve with: set -a; . {result.out / 'serve.env'}; set +a")


def import_command(
    k_file: Annotated[Path, typer.Argument(help="Key rotations (.pt, fork/RotationZoo format).")],
    v_file: Annotated[Path, typer.Argument(help="Value rotations (.pt).")],
    model: ModelOpt,
    out: Annotated[Path, typer.Option("--out", "-o", help="Artifact directory to write.")],
    clip: Annotated[Optional[str], typer.Option(help="Fixed clip ratios k=..,v=.. (default k=0.96,v=0.92).")] = None,
    group_size: Annotated[Optional[int], typer.Option(help="INT2 group size (default: min(128, head_dim)).")] = None,
    sink: Annotated[int, typer.Option(help="BF16 attention-sink tokens recorded in the artifact.")] = 64,
    recent: Annotated[int, typer.Option(help="BF16 recent-window tokens recorded in the artifact.")] = 256,
    overwrite: Annotated[bool, typer.Option(help="Replace an artifact already in --out.")] = False,
    trust_remote_code: TrustOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Turn upstream rotation files (the OSCAR SGLang fork's / RotationZoo's K and V .pt) into a
    format-v1 artifact for MODEL. Files are opened with torch.load(weights_only=True) only.
    """
    from ..spec.config import parse_clip
    from ..tools.sglang import import_sglang

    clips = parse_clip(clip)
    result = import_sglang(k_file, v_file, model, out, clip=clips, group_size=group_size, sink_tokens=sink,
                           recent_tokens=recent, overwrite=overwrite, trust_remote_code=trust_remote_code)
    if json_out:
        emit_json(result.to_dict())
        return
    md = result.artifact.metadata
    imp = result.report["imported"]
    stdout.print(f"imported {k_file.name} (v{imp['k']['format_version']}) and {v_file.name} "
                 f"(v{imp['v']['format_version']}) for {md['model_id']}: {md['num_layers']} layers, granularity "
                 f"{md['granularity']}, clips k={result.report['settings']['k_clip']} "
                 f"v={result.report['settings']['v_clip']}, eigenvalues K from {imp['k']['eigenvalues']}, "
                 f"V from {imp['v']['eigenvalues']}; artifact written to {result.out}")


export_command.__doc__ += EXPORT_EXAMPLES
import_command.__doc__ += IMPORT_EXAMPLES
