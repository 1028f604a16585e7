"""``oscar fold-weights``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ._common import (
    DeviceOpt,
    JsonOpt,
    TrustOpt,
    emit_json,
    next_step,
    quote,
    stdout,
    table,
)
from ._progress import progress_display

EXAMPLES = """
    Examples:

    * `oscar fold-weights smollm2-135m runs/smollm2-135m --out folded/smollm2-135m`
    * `oscar fold-weights ./my-llama runs/my-llama --out ./my-llama-oscar --dtype bfloat16 --shard-size 5GB`
    * `oscar fold-weights Qwen/Qwen3-8B zoo/qwen3-8b --out qwen3-8b-oscar --device cuda --json`
    * `oscar fold-weights ./GLM-4.7-FP8 runs/glm-4.7 --out ./GLM-4.7-FP8-oscar` (FP8 stays FP8)
    """


def fold_weights_command(
    model: Annotated[str, typer.Argument(help="The model the artifact was calibrated for: alias, checkpoint dir, "
                                         ".gguf file or hub id.")],
    artifact: Annotated[Path, typer.Argument(help="Artifact directory (holding oscar.safetensors) or the file "
                                             "itself.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for the folded Hugging Face checkpoint.")],
    shard_size: Annotated[str, typer.Option(help="Largest safetensors shard, e.g. 2GB, 500MB, 1GiB.")] = "2GB",
    dtype: Annotated[str, typer.Option(help="Output dtype: auto (as the input; GGUF -> float32), float32, "
                                       "bfloat16, float16. Folding and the check always run in float32/64.")] = "auto",
    device: DeviceOpt = "auto",
    trust_remote_code: TrustOpt = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a non-empty --out (only once the new checkpoint is "
                                            "complete and checked).")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Fold an artifact's value rotation into MODEL's v_proj rows and o_proj columns and write a
    standard Hugging Face checkpoint (safetensors shards, config, tokenizer) into --out.

    The folded model's V cache holds v·R, so an INT2 cache quantises it with no run-time
    rotation of V; its logits equal the original's. Before anything is written, the original and
    folded models run on a sample batch in float32: logits must agree and every layer's values
    must equal the original values times R (max relative difference ≤ 1e-4), and the saved
    checkpoint is reloaded and checked again. config.json records the folded artifact (key
    `oscar`), and the artifact is copied to --out/oscar/ marked v_folded=true, so no engine
    rotates V twice. Keys are not changed: k_rotation stays online. The artifact is validated
    first (oscar validate's rules) and must match MODEL.

    A compressed-tensors FP8 checkpoint (per-channel or per-tensor weight scales, e.g.
    GLM-4.7-FP8) is folded on its safetensors files the way the OSCAR SGLang fork absorbs R_v:
    de-quantise, rotate, fresh scales amax/448, re-quantise to FP8; written with its own
    sharding and scales format (--dtype and --shard-size do not apply); its logits and values are
    checked after re-quantisation.
    """
    from ..model.load import resolve_device
    from ..tools.fold import fold_checkpoint

    with progress_display() as progress:
        result = fold_checkpoint(model, artifact, out, dtype=dtype, device=resolve_device(device),
                                 trust_remote_code=trust_remote_code, shard_size=shard_size, overwrite=overwrite,
                                 progress=progress)
    r = result.report
    if json_out:
        emit_json(r)
        return
    c, rl = r["check"], r["reload"]
    rows = [
        ["logits, folded vs original (float32)", f"{c['logits_rel_diff']:.2e}", f"{c['tolerance']:g}", "ok"],
        ["values vs original·R, worst layer", f"{c['value_rel_err']:.2e}", f"{c['tolerance']:g}", "ok"],
        [f"logits after reload ({rl['dtype']} weights)", f"{rl['logits_rel_diff']:.2e}", f"{rl['tolerance']:g}", "ok"],
    ]
    if "value_rel_err" in rl:             # an FP8 checkpoint: its values after re-quantisation too
        rows.append([f"values after reload ({rl['dtype']} weights)", f"{rl['value_rel_err']:.2e}",
                     f"{rl['value_tolerance']:g}", "ok"])
    stdout.print(table(f"V rotation folded into {r['model_id']}", ["check", "max rel diff", "tolerance", "ok"], rows,
                       caption=f"{c['tokens'][0]}×{c['tokens'][1]} {c['input']} tokens; max|a−b| / max|a|"))
    stdout.print(f"checkpoint written to [bold]{result.out}[/bold] ({r['num_layers']} layers, {r['dtype']}, "
                 f"{r['shards']} shard(s), {r['timings']['total_s']:.1f} s); artifact copy in "
                 f"{result.out / 'oscar'} (v_folded=true)")
    next_step(f"oscar export {quote(result.out / 'oscar')} --out {quote(Path('serve') / result.out.resolve().name)} "
              "serves the folded checkpoint in the OSCAR SGLang fork (identity V rotations); transformers loads "
              f"{quote(result.out)} as it is")


fold_weights_command.__doc__ += EXAMPLES  # shown by --help
