"""``oscar export`` and ``oscar import``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ._common import (
    JsonOpt,
    TrustOpt,
    console,
    emit_json,
    next_step,
    quote,
    stdout,
    table,
    takes,
)

EXPORT_EXAMPLES = """
    Examples:

    * `oscar export --target list` (every engine, and the revision its loader was checked against)
    * `oscar export runs/qwen3-8b --out serve/qwen3-8b` then `serve/qwen3-8b/launch.sh --tensor-parallel-size 4`
    * `oscar export runs/qwen3-8b --target sglang-fork-v2 --out serve/qwen3-8b-v2` (one rotation per KV head)
    * `oscar export runs/qwen3-8b --target vllm --out serve/vllm` then `serve/vllm/launch.sh`
    * `oscar export runs/qwen3-8b --target llamacpp --gguf qwen3-8b-q4_k_m.gguf --out serve/gguf` (a new GGUF)
    * `oscar export folded/qwen3-8b/oscar --out serve/folded` (a `fold-weights` checkpoint: identity V file)
    * `oscar export runs/qwen3-8b --out serve/x --clip k=0.96,v=0.92 --sink 64 --recent 256`
    """

IMPORT_EXAMPLES = """
    Examples:

    * `oscar import k_rotation_qqt_r_h_pbr.pt v_rotation_sst_r_h_pbr.pt --model Qwen/Qwen3-8B --out runs/imported`
    * `oscar import serve/vllm/k_rotation.pt serve/vllm/v_rotation.pt --from vllm --model smollm2-135m --out runs/x`
    * `oscar import serve/gguf/model-oscar.gguf --model Qwen/Qwen3-8B --out runs/from-gguf`
    * `oscar import K.pt V.pt --model smollm2-135m --out runs/imported --clip k=0.95,v=0.9`
    """


def export_command(
    artifact: Annotated[Optional[Path], typer.Argument(help="Artifact directory.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Directory for the exported files.")] = None,
    target: Annotated[str, typer.Option(help="Engine: sglang-fork (the OSCAR fork's main), sglang-fork-v2 (its "
                                        "per-KV-head loader), sglang (upstream PR #32129), vllm (PR #46774), "
                                        "llamacpp (OSCAR's llama.cpp branch), onnxruntime (PR #31726), mlx-lm "
                                        "(PR #1789, closed), or list.")] = "sglang-fork",
    gguf: Annotated[Optional[Path], typer.Option(help="llamacpp: the model's GGUF; a copy with the rotations "
                                                 "baked in is written to --out.")] = None,
    model_path: Annotated[Optional[str], typer.Option(help="Model the server loads (default: the folded "
                                                      "checkpoint, else the artifact's base model id).")] = None,
    clip: Annotated[Optional[str], typer.Option(help="The one K and one V clip ratio to serve, k=..,v=.. (default: "
                                                "the ratios fitted for the target at calibration).")] = None,
    sink: Annotated[Optional[int], typer.Option(help="High-precision sink tokens (default: the artifact's; SGLang: "
                                                "a multiple of 8).")] = None,
    recent: Annotated[Optional[int], typer.Option(help="High-precision recent-window tokens (default: the "
                                                  "artifact's; SGLang: a multiple of 8, at least 8).")] = None,
    group_size: Annotated[Optional[int], typer.Option(help="vllm: INT2 group size to serve (at least head_dim, the "
                                                      "only size its kernel stores).")] = None,
    folded: Annotated[Optional[bool], typer.Option("--folded/--not-folded", help="Serve a checkpoint whose V rotation "
                                                   "is already folded by `oscar fold-weights` (identity V); "
                                                   "default: the artifact's v_folded flag.")] = None,
    prefill_backend: Annotated[str, typer.Option(help="SGLang: launch.sh's default prefill attention backend: "
                                                 "fa3 (sm80-sm90 GPUs: A100, H100) or triton (any GPU).")] = "fa3",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace files already in --out.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Export ARTIFACT for a serving engine: the rotation files its loader reads, serve.env with
    its environment variables, launch.sh with its command line, and settings.json (SGLang:
    clips.json) with every value explicit and the engine revision its rules were checked
    against. The files are re-read with
    the engine's loader rules before anything is installed; what the engine cannot serve is
    refused in one line. `--target list` names the engines.
    """
    from ..contract.config import parse_clip
    from ..contract.defaults import choose
    from ..errors import InputError
    from ..tools.export import TARGETS, ExportSettings, export_artifact, target_rows

    if target == "list":
        rows = target_rows()
        if json_out:
            emit_json(rows)
            return
        stdout.print(table("oscar export targets", ["target", "engine", "checked against", "status"],
                           [[r["target"], r["engine"], f"{r['repo']} @ {r['revision']}", r["status"]] for r in rows]))
        for r in rows:
            if r["note"]:
                stdout.print(f"{r['target']}: {r['note']}")
        from ..contract.features import FEATURES

        stdout.print("artifact settings each engine serves (the export names every other one it meets):")
        for r in rows:
            served = ", ".join(FEATURES[f].title for f in r["serves"]) or "none of them"
            stdout.print(f"  {r['target']}: {served}")
        return
    choose("--target", target, (*TARGETS, "list"))
    if artifact is None or out is None:
        raise InputError("oscar export needs ARTIFACT and --out (or --target list)")
    settings = ExportSettings(model_path=model_path, clip=parse_clip(clip), sink=sink, recent=recent,
                              group_size=group_size, folded=folded, gguf=gguf, prefill_backend=prefill_backend)
    result = export_artifact(artifact, out, target, settings, overwrite=overwrite)
    for w in result.warnings:
        console.print(f"[yellow]warning:[/yellow] {w}")
    if json_out:
        emit_json(result.to_dict())
        return
    stdout.print(f"exported {artifact} for {TARGETS[target].engine} ({result.checked.line()}) into {result.out}:")
    for f in result.files:
        stdout.print(f"  {result.out / f}")
    for k, v in result.launch.env.items():
        stdout.print(f"  {k}={v}")
    if result.launch.argv:
        stdout.print(f"serve with: {result.out / 'launch.sh'}")
    for n in result.launch.notes:
        stdout.print(n)
    if target.startswith("sglang") and result.launch.argv:
        from ..tools.export.sglang.export import FORK_INSTALL

        next_step(f"{quote(result.out / 'launch.sh')} starts the server on a GPU with the OSCAR SGLang fork installed "
                  f"({FORK_INSTALL})")
    elif result.launch.argv:
        next_step(f"{quote(result.out / 'launch.sh')} starts {TARGETS[target].engine} with these settings "
                  f"(settings.json records the revision they were checked against)")
    else:
        next_step(f"{quote(result.out / 'settings.json')} says how {TARGETS[target].engine} loads these files")


def import_command(
    files: Annotated[list[Path], typer.Argument(help="The engine's files: K.pt V.pt (SGLang, vLLM), one .gguf "
                                                "(llama.cpp), oscar_rotations.safetensors (ONNX Runtime) or "
                                                "k/v_rotation.safetensors (mlx-lm).")],
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="The model the rotations are for (required): "
                                                 "alias, checkpoint directory, .gguf file or hub id.",
                                                 show_default=False)] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Artifact directory to write (required).",
                                                show_default=False)] = None,
    source: Annotated[Optional[str], typer.Option("--from", help="Whose files: sglang-fork, sglang-fork-v2, sglang, "
                                                  "vllm, llamacpp, onnxruntime, mlx-lm (default: .pt pair -> "
                                                  "sglang-fork, .gguf -> llamacpp, one .safetensors -> onnxruntime, "
                                                  "two -> mlx-lm).")] = None,
    clip: Annotated[Optional[str], typer.Option(help="Fixed clip ratios k=..,v=.. (default k=0.96,v=0.92).")] = None,
    group_size: Annotated[Optional[int], typer.Option(help="INT2 group size (default: min(128, head_dim)).")] = None,
    sink: Annotated[int, typer.Option(help="BF16 attention-sink tokens recorded in the artifact.")] = 64,
    recent: Annotated[int, typer.Option(help="BF16 recent-window tokens recorded in the artifact.")] = 256,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an artifact already in --out.")] = False,
    trust_remote_code: TrustOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Turn the rotation files an engine loads (SGLang's or vLLM's K and V .pt, llama.cpp's GGUF,
    ONNX Runtime's initializers, mlx-lm's safetensors) into a format-v1 artifact for MODEL. Pickles are opened with torch.load(weights_only=True) only.
    """
    from ..contract.config import parse_clip
    from ..errors import InputError
    from ..tools.export import guess_source, import_files

    missing = [f for f in files if not f.is_file()]
    if missing:                       # the files first: nothing else matters without them
        raise InputError(f"{missing[0]}: no such file")
    if model is None or out is None:
        raise InputError(f"oscar import needs {'--model (the model the rotations are for)' if model is None else ''}"
                         f"{' and ' if model is None and out is None else ''}"
                         f"{'--out (the artifact directory to write)' if out is None else ''}")
    source = source or guess_source(files)
    result = import_files(source, files, model, out, clip=parse_clip(clip), group_size=group_size, sink_tokens=sink,
                          recent_tokens=recent, overwrite=overwrite, trust_remote_code=trust_remote_code)
    if json_out:
        emit_json(result.to_dict())
        return
    md = result.artifact.metadata
    imp = result.report["imported"]
    stdout.print(f"imported {imp['k']['file']} and {imp['v']['file']} ({imp['engine']}) for {md['model_id']}: "
                 f"{md['num_layers']} layers, granularity {md['granularity']}, clips "
                 f"k={result.report['settings']['k_clip']} v={result.report['settings']['v_clip']}; artifact written "
                 f"to {result.out}")
    for w in ("k", "v"):
        for note in imp[w]["notes"]:
            console.print(f"[yellow]note:[/yellow] {w.upper()}: {note}")
    next_step(f"oscar verify {quote(result.out)} measures the imported rotations with the INT2 kernels"
              f"{takes('verify', model)}")


export_command.__doc__ += EXPORT_EXAMPLES
import_command.__doc__ += IMPORT_EXAMPLES
