"""``oscar calibrate``."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Annotated, Iterator, Optional

import typer

from ._common import (
    DeviceMapOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    MaxMemoryOpt,
    OffloadDirOpt,
    TrustOpt,
    emit_json,
    fmt,
    more_data_hint,
    next_step,
    quote,
    stdout,
    table,
    takes,
)
from ._progress import StageClock, progress_display, starting

EXAMPLES = """
    Examples:

    * `oscar calibrate` (SmolLM2-135M on the embedded corpus, into runs/smollm2-135m)
    * `oscar calibrate --quick --out runs/first-try` (a first try: about a minute on two CPU cores)
    * `oscar calibrate gemma3-270m --tokens 16384 --out zoo/gemma3-270m`
    * `oscar calibrate ./my-llama --data corpus.jsonl --seq-len 2048 --device cuda`
    * `oscar calibrate Qwen/Qwen3-8B --config configs/qwen3-8b.yaml --clip k=0.96,v=0.92`
    * `oscar calibrate Qwen/Qwen3-8B --nproc 8` (8 data-parallel ranks, one per GPU)
    * `oscar calibrate Qwen/Qwen3-235B-A22B --device-map auto --max-memory 0=70GiB,1=70GiB,cpu=400GiB`
    * `torchrun --nproc-per-node 4 -m oscar_calib calibrate ./my-llama` (same as --nproc 4)
    """


def calibrate_command(
    model: Annotated[Optional[str], typer.Argument(help="Model alias, checkpoint dir, .gguf file or hub id "
                                                   "(default: smollm2-135m).")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Artifact directory (default: runs/MODEL).")] = None,
    config: Annotated[Optional[Path], typer.Option(help="YAML file; its 'calibration:' section sets defaults that "
                                                   "command-line options override.")] = None,
    data: Annotated[Optional[str], typer.Option(help="'embedded' (default), 'embedded-code', a .txt/.jsonl/.parquet "
                                                "file or directory, "
                                                "or a datasets hub id.")] = None,
    split: Annotated[Optional[str], typer.Option(help="Dataset split for a hub dataset (default: train).")] = None,
    text_field: Annotated[Optional[str], typer.Option(help="Text column/field (default: text).")] = None,
    tokens: Annotated[Optional[int], typer.Option(help="Calibration token budget (default: 8192).")] = None,
    seq_len: Annotated[Optional[int], typer.Option(help="Sequence length (default: 1024).")] = None,
    batch_size: Annotated[Optional[int], typer.Option(help="Sequences per forward pass (default: 1).")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Seed for choosing sequences (default: 0).")] = None,
    heldout_tokens: Annotated[Optional[int], typer.Option(help="Held-out prefix length for clip fitting "
                                                          "(default: 512).")] = None,
    heldout_seqs: Annotated[Optional[int], typer.Option(help="Held-out sequences (default: 1; with "
                                                        "--refine-steps use 8: a quarter of them validate).")] = None,
    k_objective: Annotated[Optional[str], typer.Option(help="Key objective: ktk (key second moment) or qqt "
                                                       "(query covariance, the paper's) (default: ktk).")] = None,
    v_objective: Annotated[Optional[str], typer.Option(help="Value objective: sst (exact score-weighted), "
                                                       "sst-approx (reference repo's), vtv (default: sst).")] = None,
    composition: Annotated[Optional[str], typer.Option(help="u_h_pbr, u, h or identity (default: u_h_pbr).")] = None,
    granularity: Annotated[Optional[str], typer.Option(help="head (per KV head) or layer (default: head).")] = None,
    group_size: Annotated[Optional[int], typer.Option(help="INT2 group size (default: min(128, head_dim)).")] = None,
    bit_budget: Annotated[Optional[float], typer.Option(help="Instead of one group size, spend this many stored bits "
                                                        "per element (e.g. 2.5) on a group size per layer, chosen "
                                                        "on the held-out attention error (docs: "
                                                        "guides/calibrate.md).")] = None,
    split_kv: Annotated[Optional[bool], typer.Option("--split-kv/--tied-kv", help="With --bit-budget: choose the "
                                                     "keys' and the values' group sizes apart, or one size per "
                                                     "layer for both (default: tied).", show_default=False)] = None,
    clip: Annotated[Optional[str], typer.Option(help="'fit' (default) or fixed ratios, e.g. k=0.96,v=0.92.")] = None,
    logit_correction: Annotated[Optional[float], typer.Option(help="Ask every oscar cache to subtract this share "
                                                              "(0-4) of the expected logit inflation an INT2 key's "
                                                              "rounding noise causes (default: 0 = off; docs: "
                                                              "guides/accuracy.md).")] = None,
    center_keys: Annotated[Optional[bool], typer.Option("--center-keys/--raw-keys", help="Store every key "
                                                        "centered on the calibration's mean post-RoPE key of its "
                                                        "layer and KV head (k_mean; softmax is unchanged, every INT2 "
                                                        "key group's range shrinks) (default: off; docs: "
                                                        "guides/accuracy.md).", show_default=False)] = None,
    center_fit: Annotated[Optional[str], typer.Option(help="With --center-keys: fit the key objective, the clips "
                                                      "and a bit budget's group sizes on the centered keys "
                                                      "('centered') or on the raw keys, exactly as without "
                                                      "centering, adding only k_mean ('raw') (default: "
                                                      "centered).")] = None,
    center_seq_len: Annotated[Optional[int], typer.Option(help="With --center-keys --center-fit raw: take the mean "
                                                          "key over windows of this many tokens (a second pass over "
                                                          "--tokens) instead of --seq-len's; post-RoPE keys drift "
                                                          "with position, so long contexts want a mean over long "
                                                          "windows (default: --seq-len).")] = None,
    refine_steps: Annotated[Optional[int], typer.Option(help="Refine each KV head's rotations for N Adam steps on "
                                                        "the held-out attention-output error under INT2 (Cayley, "
                                                        "kept orthogonal; never worse than the start), then refit "
                                                        "the clips (default: 0 = off; docs: design/numerics.md).")] = None,
    refine_lr: Annotated[Optional[float], typer.Option(help="Learning rate of --refine-steps (default: 2e-3).")] = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    trust_remote_code: TrustOpt = False,
    nproc: Annotated[Optional[int], typer.Option(help="Data-parallel ranks on this machine (one per GPU, or per CPU "
                                                 "core): the batches are split over them and the statistics "
                                                 "all-reduced. Not needed under torchrun / accelerate launch.")] = None,
    device_map: DeviceMapOpt = None,
    max_memory: MaxMemoryOpt = None,
    offload_dir: OffloadDirOpt = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an artifact already in --out.")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Continue an interrupted run from its checkpoint in --out.")] = False,
    checkpoint_every: Annotated[Optional[int], typer.Option(help="Checkpoint accumulators every N batches "
                                                            "(default: 4).")] = None,
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="Run `oscar verify` on the new artifact.")] = True,
    quick: Annotated[bool, typer.Option("--quick", help="A first try in about a minute on a CPU: 2048 tokens "
                                        "in 512-token sequences, 256 held-out rows for the clips, and a verify "
                                        "on one sequence at depths 512 and 1024. Costs some accuracy (docs: "
                                        "guides/calibrate.md); options given explicitly still win.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Calibrate OSCAR rotations and clip ratios for MODEL and write an artifact.

    Captures post-RoPE Q/K/V and attention outputs, streams float64 statistics per layer and KV
    head, eigendecomposes them, fits clips on held-out rows and writes oscar.safetensors,
    README.md and calibration.json into --out. Then runs `oscar verify` on it (unless
    --no-verify) and exits 1 if verification fails (the artifact stays written).
    """
    clock = StageClock()                 # from here: the time line accounts for the whole command
    from ..contract.config import config_from_options
    from ..jobs.launch import cli_argv, wants_launch
    from ..model.placement import placement_from_options

    cfg = config_from_options(config, dict(
        model=model, data=data, split=split, text_field=text_field, tokens=tokens, seq_len=seq_len,
        batch_size=batch_size, seed=seed, heldout_tokens=heldout_tokens, heldout_seqs=heldout_seqs, k_objective=k_objective,
        v_objective=v_objective, composition=composition, granularity=granularity, group_size=group_size,
        bit_budget=bit_budget, split_kv=split_kv, checkpoint_every=checkpoint_every, refine_steps=refine_steps,
        refine_lr=refine_lr, logit_correction=logit_correction, center_keys=center_keys, center_fit=center_fit,
        center_seq_len=center_seq_len, dtype=dtype, device=device,
        trust_remote_code=trust_remote_code), clip=clip,
        quick=quick)
    out = out or Path("runs") / Path(cfg.model).name.replace(".gguf", "")
    placement = placement_from_options(device_map, max_memory, offload_dir)
    if wants_launch(nproc):
        from ..calibration.parallel import (
            calibrate_parallel,  # (a single process never imports it)
        )

        raise typer.Exit(calibrate_parallel(cfg, out, nproc, cli_argv("calibrate"), overwrite=overwrite, resume=resume))
    with progress_display(enabled=os.environ.get("RANK", "0") == "0") as display, _rank_named_errors():
        with starting(display):              # (not a stage of the time line: imports count as "other")
            from ..calibration.pipeline import calibrate
        progress = clock.wrap(display)
        result = calibrate(cfg, out, overwrite=overwrite, resume=resume, progress=progress, placement=placement)
        verdict = _verify(result, progress, quick) if verify and result.rank == 0 else None
    if result.rank != 0:
        return                           # rank 0 reports and verifies
    if json_out:
        report = result.report
        emit_json({"out": str(result.out), "summary": report["summary"], "timings": report["timings"],
                   "time": clock.to_dict(),
                   "layers": [{k: v for k, v in r.items() if k != "clip_tables"} for r in report["layers"]],
                   "verify": verdict})
    else:
        _render(result, verdict)
        stdout.print(clock.line(), highlight=False, soft_wrap=True)
    next_step(_next(cfg.model, result.out, verdict), json_out=json_out)
    raise typer.Exit(0 if verdict is None or verdict["passed"] else 1)


def _next(model: str, out: Path, verdict: dict | None) -> str:
    """What to run after a calibration: verify it (--no-verify), measure or serve it (passed), or
    calibrate on more data (failed)."""
    m, art = quote(model), quote(out)
    if verdict is None:
        return (f"oscar verify {art} checks the artifact with the INT2 kernels{takes('verify', model)}, then oscar "
                f"eval {m} {art}")
    if not verdict["passed"]:
        return more_data_hint(model, out)
    return (f"oscar eval {m} {art} measures perplexity against BF16 and Hadamard{takes('eval', model)}; oscar "
            f"export {art} --out {quote(Path('serve') / out.name)} prepares serving in the OSCAR SGLang fork")


@contextlib.contextmanager
def _rank_named_errors() -> Iterator[None]:
    """Inside a rank of a data-parallel job, an error's line says which rank (once per rank)."""
    from ..errors import OscarError
    from ..jobs.env import launched

    try:
        yield
    except OscarError as e:
        rank = os.environ.get("RANK")
        if launched() and rank is not None and not str(e).startswith("rank "):
            raise type(e)(f"rank {rank}: {e}") from None
        raise


def _verify(result, progress, quick: bool) -> dict:
    """``oscar verify`` on the new artifact, with the model already loaded (spread or not)."""
    from ..eval.verify import QUICK_VERIFY, verify_artifact

    return verify_artifact(result.out, loaded=result.loaded, progress=progress,
                           **(QUICK_VERIFY if quick else {})).summary()


def _render(result, verdict: dict | None) -> None:
    """The per-layer table, where the artifact went, and the verify verdict."""
    report = result.report
    rows = []
    for r in report["layers"]:
        o, h = r["heldout"]["oscar"], r["heldout"]["hadamard"]
        rows.append([r["layer"], r["attention"].replace("_attention", ""), fmt(r["k_spread"], 1), fmt(r["v_spread"], 1),
                     _clips(r["k_clip"]), _clips(r["v_clip"]),
                     fmt(o["k"], 3), fmt(o["attn"], 3), fmt(h["attn"], 3),
                     "[green]yes[/green]" if o["attn"] < h["attn"] else "[red]no[/red]"])
    s = report["summary"]
    stdout.print(table(
        f"OSCAR calibration of {report['model_id']}",
        ["layer", "attention", "K spread", "V spread", "K clip", "V clip", "K logit err", "attn err", "Hadamard err",
         "better"], rows,
        caption=f"clips per KV head (min–max); spread = λmax/mean λ. Mean attn err {s['mean_attn_error_oscar']:.4f} "
                f"vs Hadamard {s['mean_attn_error_hadamard']:.4f}; better on {s['layers_better_than_hadamard']}/"
                f"{s['num_layers']} layers. Errors are relative RMS errors (0 = exact, lower is better) on "
                f"{report['calibration']['heldout_tokens']} held-out tokens with every token INT2 ("
                f"{'each layer its group' if report.get('bit_budget') else 'group ' + str(report['group_size'])}, no BF16 sink or window: the harshest case, the one the clips are fitted "
                "on); Hadamard = the data-free rotation with clips 0.96/0.92."))
    if report.get("bit_budget"):
        b = report["bit_budget"]
        sizes = (f"key group sizes per layer {b['layer_group_sizes']}, value {b['layer_v_group_sizes']}"
                 if b.get("layer_v_group_sizes") else f"group sizes per layer {b['layer_group_sizes']}")
        stdout.print(f"bit budget {b['bits']:g}: {sizes} ({b['mean_bits']:.3f} "
                     f"bits per element, {b['long_bits']:.3f} at long contexts); held-out attn err "
                     f"{b['heldout_attn']['per_layer']:.4f} vs {b['heldout_attn']['uniform']:.4f} with one size "
                     f"{b['uniform_group_size']} ({b['uniform_bits']:g} bits)")
    stdout.print(f"artifact written to [bold]{result.out}[/bold]  ({report['calibration']['tokens']} tokens)")
    if verdict is not None:
        state = "[green]PASS[/green]" if verdict["passed"] else "[red]FAIL[/red]"
        stdout.print(f"verify {state}: mean attention error {verdict['mean_attn_error']:.4f} vs Hadamard "
                     f"{verdict['mean_attn_error_hadamard']:.4f} ({result.out}/verify.json). A different measure "
                     "from the table's: the serving layout (BF16 sink and recent window, INT2 history between) "
                     "through the INT2 kernels on the corpus' other held-out half, usually lower; lower is "
                     "better.")
        for r in verdict["reasons"]:
            stdout.print(f"  - {r}")


def _clips(values: list[float]) -> str:
    """One number when all heads agree, else min–max."""
    lo, hi = min(values), max(values)
    return f"{lo:.2f}" if lo == hi else f"{lo:.2f}–{hi:.2f}"


calibrate_command.__doc__ += EXAMPLES  # shown by --help
