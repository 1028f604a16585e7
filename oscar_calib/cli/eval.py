"""``oscar eval``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..contract.defaults import DEFAULT_RECENT, DEFAULT_SINK
from ._common import (
    DeviceMapOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    MaxMemoryOpt,
    OffloadDirOpt,
    emit_json,
    next_step,
    quote,
    stdout,
    table,
    takes,
)
from ._progress import progress_display, starting


def eval_command(
    model: Annotated[str, typer.Argument(help="Model alias, checkpoint dir, .gguf file or hub id.")],
    artifact: Annotated[Optional[Path], typer.Argument(help="Artifact directory for the 'oscar' method "
                                                       "(without it, 'oscar' is left out).")] = None,
    task: Annotated[str, typer.Option(help="ppl (held-out perplexity) or niah (needle in a haystack).")] = "ppl",
    methods: Annotated[Optional[str], typer.Option(help="Comma-separated: bf16, naive, hadamard, oscar, fork (the OSCAR SGLang "
                                         "fork's scheme for ARTIFACT), fork-lloyd, vllm, llamacpp (those engines' "
                                         "schemes; ppl only), quanto. Default: bf16,hadamard,oscar,fork, about a "
                                         "minute for SmolLM2 on 2 CPU cores. naive, fork-lloyd, vllm, llamacpp and "
                                         "quanto run only when named; quanto is slow: it decodes token by token "
                                         "(about 2.5 min per 2048-token sequence for SmolLM2 on 2 CPU cores).",
                                         show_default=False)]
    = None,
    group_size: Annotated[Optional[int], typer.Option(help="INT2 group size (default: the artifact's, else "
                                                     "min(128, head_dim)).")] = None,
    logit_correction: Annotated[Optional[float], typer.Option(help="Gain (0-4) of the logit-noise correction "
                                                              "for the 'oscar' method (default: the artifact's; "
                                                              "0 = off).")] = None,
    sink: Annotated[int, typer.Option(help="BF16 attention-sink tokens.")] = DEFAULT_SINK,
    recent: Annotated[int, typer.Option(help="BF16 recent-window tokens.")] = DEFAULT_RECENT,
    sequences: Annotated[Optional[int], typer.Option(help="ppl: held-out sequences (default 1; each one is a "
                                                     "forward pass per method).", show_default=False)] = None,
    seq_len: Annotated[int, typer.Option(help="ppl: tokens per sequence.")] = 2048,
    data: Annotated[str, typer.Option(help="ppl: 'embedded' (pydoc topics) or 'embedded-code' (stdlib source), "
                                      "their held-out half; or a text file/dir.")] = "embedded",
    context: Annotated[Optional[str], typer.Option(help="ppl: long contexts, comma-separated (e.g. 8192,32768): "
                                                   "--sequences windows of each length, the last --scored "
                                                   "predictions scored after a full-precision prefill of the rest.")]
    = None,
    scored: Annotated[Optional[int], typer.Option(help="ppl: predictions scored at the end of each window "
                                                  "(default: 1024 with --context, half a window below 2048; "
                                                  "every one without).")] = None,
    real_cache: Annotated[bool, typer.Option("--real-cache", help="ppl: score naive/hadamard/oscar through "
                                             "OscarCache itself, one decode step per scored prediction (the "
                                             "Triton kernels on a GPU), instead of the simulation.")] = False,
    lengths: Annotated[str, typer.Option(help="niah: context lengths, comma-separated.")] = "1024,2048,4096,8192",
    depths: Annotated[str, typer.Option(help="niah: needle depths in [0, 1], comma-separated.")]
    = "0,0.25,0.5,0.75,1",
    samples: Annotated[int, typer.Option(help="niah: prompts per (length, depth).")] = 1,
    prompts: Annotated[Optional[int], typer.Option(help="niah: at least this many prompts per length (sets --samples "
                                                   "to ceil(N / depths)); 50 or more tells methods apart, the "
                                                   "default 5 shows a trend.")] = None,
    haystack: Annotated[str, typer.Option(help="niah filler: corpus (held-out sentences), noise (RULER's "
                                          "repeated sentences) or prose (generated; the same text on every "
                                          "Python).")] = "corpus",
    seed: Annotated[int, typer.Option(help="Seed for held-out sequences / needles.")] = 0,
    plot: Annotated[Optional[Path], typer.Option(help="PNG to write (default: eval-MODEL-TASK.png in the working "
                                                 "directory, never inside the artifact, which `push` uploads).")]
    = None,
    record: Annotated[bool, typer.Option("--record", help="Store the results in ARTIFACT/calibration.json and its model card.")]
    = False,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    device_map: DeviceMapOpt = None,
    max_memory: MaxMemoryOpt = None,
    offload_dir: OffloadDirOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Evaluate a 2-bit KV cache: held-out perplexity or needle retrieval, per method.

    Every INT2 method keeps the first --sink and the last --recent tokens in BF16. ppl is
    teacher-forced and faithful to decoding (each query position reads its own window in BF16,
    everything older as INT2); niah prefills in full precision and answers with model.generate()
    through the method's cache (OscarCache for naive/hadamard/oscar/fork, transformers'
    QuantizedCache for quanto).

    fork simulates what the OSCAR SGLang fork's main serves for ARTIFACT (`oscar export`'s
    settings): one rotation per layer held in BF16, one K and one V clip ratio for the whole
    model, the artifact's group size and windows, float32 scales (2 + 64/G bits); fork-lloyd adds
    its Lloyd-Max buckets. In niah, fork runs through OscarCache (fp16 scales). vllm and llamacpp
    simulate those engines' schemes (`oscar export --target vllm|llamacpp`); with --record they
    go to the card's "What each engine costs" table, not its main one.

    Examples:

    * `oscar eval smollm2-135m zoo/smollm2-135m`
    * `oscar eval gemma3-270m zoo/gemma3-270m --methods bf16,hadamard,oscar --json`
    * `oscar eval smollm2-135m zoo/smollm2-135m --task niah --lengths 2048,8192 --methods bf16,hadamard,oscar`
    * `oscar eval smollm2-135m zoo/smollm2-135m --task niah --prompts 50 --lengths 2048` (intervals that decide)
    * `oscar eval Qwen/Qwen3-32B runs/qwen3-32b --device-map auto --methods bf16,oscar` (spread over the GPUs)
    * `oscar eval smollm2-135m zoo/smollm2-135m --methods bf16,oscar,fork,vllm,llamacpp --record` (engine costs)
    * `oscar eval gemma3-270m zoo/gemma3-270m --methods bf16,oscar --logit-correction 0.5` (try a gain)
    * `oscar eval smollm2-135m zoo/smollm2-135m --methods bf16,hadamard,oscar --context 4096,8192 --sequences 1`
      (the last 1,024 tokens of long windows; minutes on a CPU, seconds on a GPU)
    * `oscar eval gemma3-270m zoo/gemma3-270m --methods bf16,hadamard,oscar --context 8192,32768 --sequences 1
      --real-cache --device cuda` (through OscarCache and its kernels)

    --context scores the last --scored predictions (1,024 by default) of windows of each length: the rest of
    each window is prefilled at full precision, as a serving engine prefills a prompt, and every scored
    token reads a long INT2 history. A text too short for the windows asked is refused with what fits
    (the embedded corpus' held-out half holds about 55K SmolLM2 tokens: one window of 32,768).
    """
    from ..errors import InputError
    from ..model.placement import placement_from_options
    from ..tools.zoo import refresh_index

    if record and (artifact is None or not artifact.is_dir()):
        raise InputError("--record needs an ARTIFACT directory")
    if record and logit_correction is not None:
        raise InputError("--record stores what the artifact serves: leave out --logit-correction (calibrate with "
                         "it instead)")
    plot = plot or Path(f"eval-{Path(model).name.removesuffix('.gguf')}-{task}.png")
    placement = placement_from_options(device_map, max_memory, offload_dir)
    with progress_display() as progress:
        with starting(progress):
            from ..eval import EvalOptions, run_eval
            from ..eval.report import record_eval
        given = {k: v for k, v in (("methods", methods), ("sequences", sequences)) if v is not None}   # or defaults
        options = EvalOptions(task=task, group_size=group_size, logit_correction=logit_correction,
                              sink=sink, recent=recent, seed=seed, seq_len=seq_len, data=data, lengths=lengths,
                              depths=depths, samples=samples, prompts=prompts, haystack=haystack,
                              contexts=context or (), scored=scored, real_cache=real_cache, **given)
        result = run_eval(model, artifact, options, device=device, dtype=dtype, plot=plot, progress=progress,
                          placement=placement)
    if record:
        serving = None
        if result.settings.get("engines"):          # an engine-cost table: the serving commands go beside it
            from ..tools.export import serving_table

            serving = serving_table(artifact)
        record_eval(artifact, result, serving=serving)
        result.settings["recorded"] = str(artifact)
        index = refresh_index(artifact)             # a zoo entry: its zoo's index describes it again
        if index is not None:
            result.settings["index_refreshed"] = str(index)
    render(result, json_out)
    next_step(_next(model, artifact, record), json_out=json_out)


def _next(model: str, artifact: Path | None, record: bool) -> str:
    from ..tools.zoo import zoo_of

    m = quote(model)
    if artifact is None:
        return (f"oscar calibrate {m} --out {quote(Path('runs') / Path(model).name)} makes an artifact to compare"
                f"{takes('calibrate', model)}")
    if record:
        return f"oscar push {quote(artifact)} --to hf:ORG/NAME --dry-run shows what a push would upload, card included"
    store = ("add --record to store these results in the zoo entry's card (it rewrites committed files and the zoo's "
             "index)" if zoo_of(artifact) is not None else f"add --record to store these results in {quote(artifact)}'s card")
    return (f"{store}; oscar export {quote(artifact)} --out {quote(Path('serve') / artifact.resolve().name)} prepares "
            "serving")


def render(result, json_out: bool) -> None:
    if json_out:
        emit_json(result.to_json())
        return
    s = result.settings
    if result.task == "ppl" and s.get("contexts"):
        from rich.markup import escape

        from ..eval.report import context_caption, context_cells

        doc = result.to_json()
        headers, rows = context_cells(doc)
        stdout.print(table(f"oscar eval ppl at long contexts: {result.model_id}", headers, rows,
                           caption=escape(context_caption(doc)) + ". Lower is better, BF16 is the floor; bits with "
                                   "windows: what the real cache holds per element at that length, its 16-bit sink "
                                   "and window included"))
        _fork_line(s)
    elif result.task == "ppl":
        from ..eval.report import group_label

        rows = [[r["method"], f"{r['bits_per_element']:.3f}", group_label(r).replace("-", "–"), f"{r['ppl']:.3f}",
                 f"{r['gap_closed_vs_hadamard']:+.0%}" if "gap_closed_vs_hadamard" in r else "–"]
                for r in result.rows]
        quanto = "; quanto: QuantizedCache defaults (no sink, residual 128)" if "quanto" in s.get("methods", ()) else ""
        stdout.print(table(f"oscar eval ppl: {result.model_id}", ["method", "bits/elem", "group", "perplexity",
                                                                  "Hadamard→BF16 gap closed"], rows,
                           caption=f"{s['sequences']}×{s['seq_len']} held-out tokens; BF16 sink {s['sink']} + recent "
                                   f"{s['recent']} per query position{quanto}. Perplexity of the held-out text: "
                                   "lower is better, BF16 is the floor; gap closed: the share of Hadamard's "
                                   "distance to BF16 a method removes (100% = as good as BF16)"))
        if s.get("real_cache"):
            stdout.print("scored through: " + "; ".join(f"{m} {path}" for m, path in s["paths"].items()))
        _fork_line(s)
    else:
        from ..eval.stats import format_rate

        summ = result.summary()
        lengths = list(summ[0]["by_length"]) if summ else []
        rows = [[r["method"], f"{r['bits_per_element']:.3f}"]
                + [format_rate(r["by_length"][k], r["by_length_interval"][k]) for k in lengths]
                + [format_rate(r["accuracy"], r["interval"])] for r in summ]
        stdout.print(table(f"oscar eval niah: {result.model_id}", ["method", "bits/elem"] + lengths + ["all"], rows,
                           caption=f"exact match over depths {s['depths']} × {s['samples']} sample(s) "
                                   f"({len(s['depths']) * s['samples']} prompts per length); haystack "
                                   f"{s['haystack']}. Share of needles retrieved [95% Wilson interval]: higher is "
                                   "better, 1.00 = every one; BF16 is what the model manages without quantisation; "
                                   "overlapping intervals do not tell two methods apart (--prompts 50 narrows them)"))
        _fork_line(s)
    for note in s.get("notes") or []:
        stdout.print(f"note: {note}")
    if s.get("plot"):
        stdout.print(f"plot written to {s['plot']}")
    if s.get("recorded"):
        stdout.print(f"results recorded in {s['recorded']}/calibration.json and its README.md"
                     + (f"; {s['index_refreshed']} refreshed" if s.get("index_refreshed") else ""), highlight=False)


def _fork_line(settings: dict) -> None:
    if settings.get("fork"):
        from ..eval.report import fork_note

        stdout.print(fork_note(settings["fork"]), highlight=False)
