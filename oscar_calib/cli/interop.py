"""``oscar export`` and ``oscar import``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ._common import JsonOpt, ModelOpt, TrustOpt, console, emit_json, next_step, quote, stdout

EXPORT_EXAMPLES = """
    Examples:

    * `oscar export runs/qwen3-8b --out serve/qwen3-8b` then `serve/qwen3-8b/launch.sh --tensor-parallel-size 4`
    * `oscar export runs/qwen3-8b --out serve/qwen3-8b-pr20 --target pr20` (per-KV-head rotations; a fork build
      with its PR #20)
    * `oscar export folded/qwen3-8b/oscar --out serve/folded` (a `fold-weights` checkpoint: identity V file)
    * `oscar export runs/qwen3-8b --out serve/x --clip k=0.96,v=0.92 --sink 64 --recent 256`
    """

IMPORT_EXAMPLES = """
    Examples:

    * `oscar import k_rotation_qqt_r_h_pbr.pt v_rotation_sst_r_h_pbr.pt --model Qwen/Qwen3-8B --out runs/qwen3-8b-imported`
    * `oscar import K.pt V.pt --model smollm2-135m --out runs/imported --clip k=0.95,v=0.9`
    """

FORMATS = ("sglang",)


def export_command(
    artifact: Annotated[Path, typer.Argument(help="Artifact directory.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for the exported files.")],
    fmt_name: Annotated[str, typer.Option("--format", help="Target format: sglang (the OSCAR SGLang "
                                          "fork).")] = "sglang",
    target: Annotated[str, typer.Option(help="fork-main (one rotation per layer: what the fork's main loads) or "
                                        "pr20 (one per KV head: needs a fork build with its PR #20).")] = "fork-main",
    model_path: Annotated[Optional[str], typer.Option(help="--model-path for the server (default: the folded "
                                                      "checkpoint, else the artifact's base model id).")] = None,
    clip: Annotated[Optional[str], typer.Option(help="The one K and one V clip ratio to serve, k=..,v=.. (default: "
                                                "the ratios fitted for the target at calibration).")] = None,
    sink: Annotated[Optional[int], typer.Option(help="BF16 sink tokens (default: the artifact's; a multiple of "
                                                "8).")] = None,
    recent: Annotated[Optional[int], typer.Option(help="BF16 recent-window tokens (default: the artifact's; a "
                                                  "multiple of 8, at least 8).")] = None,
    folded: Annotated[Optional[bool], typer.Option("--folded/--not-folded", help="Serve a checkpoint whose V rotation "
                                                   "is already folded by `oscar fold-weights` (identity V file); "
                                                   "default: the artifact's v_folded flag.")] = None,
    prefill_backend: Annotated[str, typer.Option(help="launch.sh's default prefill attention backend: fa3 "
                                                 "(sm80-sm90 GPUs: A100, H100) or triton (any GPU).")] = "fa3",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace files already in --out.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Export ARTIFACT for serving in the OSCAR SGLang fork: the K and V rotation files it loads,
    serve.env with its SGLANG_* settings (windows, the one K and one V clip ratio, V absorption),
    launch.sh with its server flags, and clips.json. The files are checked against the fork's
    loader rules before anything is written.
    """
    from ..spec.config import parse_clip
    from ..spec.defaults import choose
    from ..tools.sglang import export_sglang
    from ..tools.sglang.export import FORK_INSTALL

    choose("--format", fmt_name, FORMATS)
    result = export_sglang(artifact, out, target=target, model_path=model_path, clip=parse_clip(clip), sink=sink,
                           recent=recent, folded=folded, prefill_backend=prefill_backend, overwrite=overwrite)
    for w in result.warnings:
        console.print(f"[yellow]warning:[/yellow] {w}")
    if json_out:
        emit_json(result.to_dict())
        return
    s = result.settings
    stdout.print(f"exported {artifact} for the OSCAR SGLang fork ({result.target}, rotation format_version "
                 f"{result.format_version}) into {result.out}:")
    for f in result.files:
        stdout.print(f"  {result.out / f}")
    stdout.print(f"clips k={s.k_clip:g} v={s.v_clip:g} ({result.clip_source}); windows {s.sink} + {s.recent} BF16; "
                 f"group {s.group_size}; V {'identity (folded checkpoint)' if s.v_identity else 'absorbed at load' if s.absorb_v else 'rotated online'}")
    stdout.print(f"serve with: {result.out / 'launch.sh'}   (model: {s.model_path})")
    next_step(f"{quote(result.out / 'launch.sh')} starts the server on a GPU with the OSCAR SGLang fork installed "
              f"({FORK_INSTALL})")


def import_command(
    k_file: Annotated[Path, typer.Argument(help="Key rotations (.pt, fork/RotationZoo format).")],
    v_file: Annotated[Path, typer.Argument(help="Value rotations (.pt).")],
    model: ModelOpt,
    out: Annotated[Path, typer.Option("--out", "-o", help="Artifact directory to write.")],
    clip: Annotated[Optional[str], typer.Option(help="Fixed clip ratios k=..,v=.. (default k=0.96,v=0.92).")] = None,
    group_size: Annotated[Optional[int], typer.Option(help="INT2 group size (default: min(128, head_dim)).")] = None,
    sink: Annotated[int, typer.Option(help="BF16 attention-sink tokens recorded in the artifact.")] = 64,
    recent: Annotated[int, typer.Option(help="BF16 recent-window tokens recorded in the artifact.")] = 256,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an artifact already in --out.")] = False,
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
    next_step(f"oscar verify {quote(result.out)} measures the imported rotations with the INT2 kernels")


export_command.__doc__ += EXPORT_EXAMPLES
import_command.__doc__ += IMPORT_EXAMPLES
