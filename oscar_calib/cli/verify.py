"""``oscar verify``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ._common import (
    DeviceMapOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    MaxMemoryOpt,
    OffloadDirOpt,
    emit_json,
    fmt,
    more_data_hint,
    next_step,
    quote,
    stdout,
    table,
    takes,
)
from ._progress import progress_display, starting


def verify_command(
    artifact: Annotated[Path, typer.Argument(help="Artifact directory (or its oscar.safetensors).")],
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Model the artifact was calibrated for "
                                                 "(default: the artifact's model_id).")] = None,
    backend: Annotated[str, typer.Option(help="Kernels: auto (Triton on CUDA, torch reference on CPU or "
                                         "without triton), triton (on CPU: the Triton interpreter, slow; "
                                         "needs triton, Linux only), torch.")] = "auto",
    depths: Annotated[str, typer.Option(help="Context lengths to test, comma-separated.")] = "512,1024,2048",
    sequences: Annotated[int, typer.Option(help="Held-out sequences.")] = 2,
    positions: Annotated[int, typer.Option(help="Query positions per depth and sequence.")] = 8,
    data: Annotated[str, typer.Option(help="Held-out text: 'embedded' or 'embedded-code' (the held-out half) or a "
                                      "file/dir.")] = "embedded",
    max_layer_error: Annotated[float, typer.Option(help="Fail when any layer's relative attention-output error "
                                                   "exceeds this.")] = 0.5,
    seed: Annotated[int, typer.Option(help="Seed for choosing held-out sequences.")] = 0,
    record: Annotated[bool, typer.Option("--record", help="Also write verify.json and verify.png into a zoo entry "
                                         "(an artifact below a zoo's index.json, such as zoo/smollm2-135m) and "
                                         "refresh the index. Other artifacts get them always.")] = False,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    device_map: DeviceMapOpt = None,
    max_memory: MaxMemoryOpt = None,
    offload_dir: OffloadDirOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Check an artifact with the INT2 kernels on held-out activations.

    Writes K/V through the write kernel (BF16 sink and recent window, INT2 history), runs the
    decode kernel at several depths and compares with full-precision attention, for the artifact
    and for a Hadamard baseline (clips 0.96/0.92). Passes (exit 0) when the artifact's mean error
    is below the baseline's and no layer exceeds --max-layer-error; otherwise exit 1. Writes
    verify.json and verify.png into the artifact directory; verify.json records the content
    digest it verified, so a later change to the artifact makes it stale (`oscar push` then
    refuses it). A zoo entry (committed under zoo/) is only measured unless --record is given:
    then its files and the zoo's index.json are rewritten together. The artifact is validated
    first (oscar validate's rules, its digest included).

    Examples:

    * `oscar verify runs/demo`
    * `oscar verify zoo/smollm2-135m --model smollm2-135m --depths 1024,4096 --json`
    * `oscar verify runs/qwen3-32b --device-map auto --max-memory 0=70GiB,1=70GiB,cpu=200GiB` (a model spread
      over GPUs, CPU and disk: each layer is checked in turn on the first GPU)
    """
    from ..errors import InputError
    from ..model.placement import placement_from_options
    from ..tools.zoo import refresh_index, zoo_display, zoo_of

    try:
        depth_list = [int(x) for x in depths.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"--depths expects comma-separated integers, got {depths!r}") from None
    directory = artifact.parent if artifact.is_file() else artifact
    zoo = zoo_of(directory)
    write = zoo is None or record
    placement = placement_from_options(device_map, max_memory, offload_dir)
    with progress_display() as progress:
        with starting(progress):
            from ..eval.verify import verify_artifact
        result = verify_artifact(directory, model=model, device=device, dtype=dtype, backend=backend,
                                 depths=depth_list, sequences=sequences, positions=positions, data=data,
                                 max_layer_error=max_layer_error, seed=seed, write=write, progress=progress,
                                 placement=placement)
    index = refresh_index(directory) if zoo is not None and write else None
    render(result, json_out)
    if not json_out:
        if zoo is not None and write:
            stdout.print(f"recorded in {directory}/verify.json and verify.png"
                         + (f"; {index} refreshed" if index is not None else ""), highlight=False)
        elif not write:
            stdout.print(f"{directory} is a zoo entry: nothing written (--record writes verify.json and verify.png "
                         f"and refreshes {zoo_display(zoo)}/index.json)", highlight=False)
    next_step(_next(model, directory, result.passed), json_out=json_out)
    raise typer.Exit(0 if result.passed else 1)


def _next(model: str | None, directory: Path, passed: bool) -> str:
    from ..contract.artifact import read_metadata
    from ..model.source import model_for_artifact

    spec = model or model_for_artifact(read_metadata(directory))
    m, art = quote(spec), quote(directory)
    if not passed:
        return more_data_hint(spec, directory)
    return (f"oscar eval {m} {art} measures perplexity against BF16 and Hadamard{takes('eval', spec)}; oscar export "
            f"{art} --out {quote(Path('serve') / directory.resolve().name)} prepares serving in the OSCAR SGLang fork")


def render(result, json_out: bool) -> None:
    s = result.summary()
    if json_out:
        emit_json(result.to_json())
        return
    fork = "mean_attn_error_fork" in s
    rows = [[r["layer"], r["attention"].replace("_attention", ""), fmt(r["artifact"]["attn"]),
             fmt(r["hadamard"]["attn"])] + ([fmt(r["fork"]["attn"])] if fork else [])
            + [fmt(r["artifact"]["logit"]), fmt(r["hadamard"]["logit"])] for r in result.layers]
    stdout.print(table("oscar verify", ["layer", "attention", "attn err", "Hadamard attn"] + (["fork attn"] if fork else [])
                       + ["logit err", "Hadamard logit"], rows,
                       caption=f"depths {result.settings['depths']}, backend {result.settings['backend']}. Relative "
                               "errors against full precision (0 = exact, lower is better) with the serving layout: "
                               "BF16 sink and recent window, INT2 history between; attn = the attention output at "
                               "the decoded position, logit = its scores q·kᵀ. Passes when the mean attn error is "
                               "below Hadamard's (the data-free rotation, clips 0.96/0.92) and no layer exceeds "
                               f"{result.settings['max_layer_error']}."
                               + (" fork attn: the OSCAR SGLang fork's scheme for this artifact (one rotation per "
                                  "layer, global clips, float32 scales; pure-torch simulation)." if fork else "")))
    verdict = "[green]PASS[/green]" if result.passed else "[red]FAIL[/red]"
    stdout.print(f"{verdict}: mean attention error {s['mean_attn_error']:.4f} vs Hadamard "
                 f"{s['mean_attn_error_hadamard']:.4f}; worst layer {s['worst_layer']} "
                 f"({s['max_layer_attn_error']:.4f}, threshold {result.settings['max_layer_error']})")
    if fork:
        f = result.settings["fork"]
        stdout.print(f"served by the OSCAR SGLang fork (clips k={f['k_clip']:g} v={f['v_clip']:g}, group "
                     f"{f['group_size']}): mean attention error {s['mean_attn_error_fork']:.4f} (informational)")
    for r in result.reasons:
        stdout.print(f"  - {r}")
