#!/usr/bin/env python
"""Levers that see long windows, measured at 8K/16K/32K in one run: perplexity of the last tokens of
long windows for BF16, Hadamard, the zoo artifact and the levers on it, one JSON and a table.

    # on the GPU machine: the models carried there (a GGUF path per model; the gguf package in
    # /root/site), Gemma's tokenizer as transformers 5.23 converts it (save_tokenizer.py, 31.8 MiB);
    # one model per call, the JSON and its table under $OUT
    PYTHONPATH=/root/site python scripts/experiments/long_levers.py --device cuda \
        --model smollm2-135m=/root/m/SmolLM2-135M-Instruct.Q4_1.gguf --lengths smollm2-135m=8192 \
        --texts embedded,embedded-code --real-cache zoo --out $OUT/long_levers_smollm2-135m_h200.json
    PYTHONPATH=/root/site python scripts/experiments/long_levers.py --device cuda \
        --model gemma3-270m=/root/m/gemma-3-270m-q4_k_m.gguf --tokenizer gemma3-270m=.gpu/gemma3-270m-tokenizer \
        --lengths gemma3-270m=8192,16384,32768 --out $OUT/long_levers_gemma3-270m_h200.json
    # on a CPU: SmolLM2 at 2K, two windows, every prediction (oscar eval's protocol); 45 min on 2 busy cores
    python scripts/experiments/long_levers.py --model smollm2-135m --lengths smollm2-135m=2048 --sequences 2 \
        --scored all --texts embedded,embedded-code --variants bf16,hadamard,zoo,gain=0,channel,channel-kivi \
        --device cpu --out scripts/experiments/results/long_levers_smollm2-135m_cpu.json

Each model is a zoo alias (its artifact ``zoo/<alias>``, its recipe ``configs/<alias>.yaml``),
optionally loaded from another path (``--model ALIAS=PATH``: a GGUF or checkpoint carried to the
machine); ``--tokenizer ALIAS=DIR`` loads its tokenizer from a saved folder instead (the GPU
machine's transformers 5.17 builds Gemma-3's GGUF tokenizer without merges, which ``oscar``
refuses: ``oscar_calib.model.load.check_tokenizer``).

Scoring is ``oscar eval --context``'s (:mod:`oscar_calib.eval.context`): ``--sequences`` windows of
each length of the held-out text, the rest prefilled at full precision, the last
``scored_predictions(L)`` predictions (1,024; ``--scored``) scored through the simulation
(``SimulatedKV``, which models the real cache's window exactly). Rows, per model, length and text:

=====================  ===================================================================================
variant                what the cache holds
=====================  ===================================================================================
``bf16``               16-bit keys and values (the reference)
``hadamard``           QuaRot-INT2 at the artifact's group size (clips 0.96/0.92)
``zoo``                the zoo artifact as it serves: rotations, clips, group sizes, sink 64 + recent 256,
                       its logit-noise correction (gain 0.5)
``gain=A``             the zoo artifact with the correction at gain ``A`` (``--gains``, default 0, 0.25,
                       1): the best gain per length against ``int2_keys``, the INT2 keys a scored query
                       reads in a full-attention layer
``window=S+R``         the zoo artifact with sink ``S`` and recent ``R`` (``--window``, default the OSCAR
                       fork's Qwen3-8B recipe 128 + 2048): ``bits_at_context`` counts the 16-bit window
``long-cal``           the zoo's recipe calibrated again on long sequences (``--cal-seq-len``, default
                       8192, 16384 for a model whose longest length is above 16K; two sequences of the
                       corpus' calibration half; held-out rows: the first ``--cal-heldout`` tokens of a
                       third), so statistics and clips see far positions (RoPE turns the slow channels'
                       mean with position)
``channel``            keys quantised per channel in blocks of G tokens as they leave the window
                       (``oscar_calib.experimental.channel``, the zoo's rotations, no correction): compare
                       with ``gain=0`` (the same bits)
``channel-kivi``       the same without rotation (KIVI's keys)
``channel-clip``       ``channel`` after the zoo's per-row key clip (not in the default set)
=====================  ===================================================================================

``--real-cache zoo,hadamard`` also scores those rows through ``OscarCache`` itself (its prefill, then
one decode step per scored prediction: the Triton kernels on a GPU), a ``ppl_real`` column that
checks the simulation at that length (about a minute per row and window at 1,024 scored
predictions on Gemma, H200).

``VARIANTS`` maps each name to the function that builds its scheme; a new lever is one entry.
The JSON (``--out``) is rewritten after every row, so a run cut short keeps what it measured; the
table is printed last and written beside it (``.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

DEFAULT_VARIANTS = "bf16,hadamard,zoo,gain,window,long-cal,channel,channel-kivi"
GAINS = "0,0.25,1"


@dataclasses.dataclass
class Model:
    """One model under test and what every variant needs from it."""

    alias: str
    lm: object
    zoo: object               # the zoo artifact's KVScheme
    artifact: object
    windows: list             # per layer: sliding window or None
    lengths: list
    recipe: Path              # the calibration recipe long-cal re-runs
    extra: dict = dataclasses.field(default_factory=dict)     # what variants record about themselves


def _pairs(items: list[str], option: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise SystemExit(f"error: {option} {item!r}: expected ALIAS=VALUE")
        out[key] = value
    return out


def load(alias: str, path: str | None, tokenizer: str | None, device: str, dtype: str):
    """The model (its alias, or ``path`` recorded under the alias' model id) with its tokenizer, or
    the one saved in ``tokenizer`` (checked as every tool checks one)."""
    from oscar_calib.model.load import check_tokenizer, load_model
    from oscar_calib.model.source import ALIASES

    tok = None
    if tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
        check_tokenizer(tokenizer, tok)
    lm = load_model(path or alias, device=device, dtype=dtype, tokenizer=tok)
    if path and alias in ALIASES:
        lm.source = dataclasses.replace(lm.source, model_id=ALIASES[alias]["model_id"])
    return lm


def zoo_scheme(lm, artifact_dir: Path):
    from oscar_calib.contract.artifact import load_artifact, require_compatible
    from oscar_calib.runtime import KVScheme

    art = load_artifact(artifact_dir)
    require_compatible(art, lm.geometry, None, model_name=lm.source.model_id)   # geometry; versions write other configs
    return art, KVScheme.from_artifact(art, name="zoo")


# ------------------------------------------------------------------------------------------ variants
def v_bf16(m: Model, args, name: str):
    from oscar_calib.runtime import KVScheme

    return [(name, KVScheme.full_precision(m.zoo.num_layers))]


def v_hadamard(m: Model, args, name: str):
    from oscar_calib.eval import build_schemes

    return [(name, build_schemes(["hadamard"], m.lm.geometry, group_size=m.zoo.group_size)["hadamard"])]


def v_zoo(m: Model, args, name: str):
    return [(name, m.zoo)]


def v_gain(m: Model, args, name: str):
    """``gain`` alone: every gain of ``--gains``; ``gain=A``: that one."""
    gains = [float(g) for g in (name.partition("=")[2] or args.gains).split(",")]
    return [(f"gain={g:g}", dataclasses.replace(m.zoo, name=f"gain={g:g}", logit_correction=g)) for g in gains]


def v_window(m: Model, args, name: str):
    spec = name.partition("=")[2] or args.window
    sink, recent = (int(x) for x in spec.split("+"))
    return [(f"window={sink}+{recent}", dataclasses.replace(m.zoo, name=f"window={sink}+{recent}", sink=sink,
                                                            recent=recent))]


def v_long_cal(m: Model, args, name: str):
    """The zoo's recipe calibrated on long sequences (module docstring)."""
    from oscar_calib import calibrate
    from oscar_calib.contract.config import from_mapping, load_yaml_section
    from oscar_calib.runtime import KVScheme

    seq = args.cal_seq_len or (16384 if max(m.lengths) > 16384 else 8192)
    recipe = load_yaml_section(m.recipe)
    cfg = from_mapping({**recipe, "model": m.alias, "tokens": 2 * seq, "seq_len": seq,
                        "heldout_tokens": min(args.cal_heldout, seq), "device": args.device, "dtype": args.dtype},
                       where="long-cal")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        res = calibrate(cfg, Path(tmp) / "art", loaded=m.lm)
        scheme = KVScheme.from_artifact(res.artifact, name=f"long-cal{seq}")
    m.extra[f"long-cal{seq}"] = {"seq_len": seq, "tokens": 2 * seq, "heldout_tokens": cfg.heldout_tokens,
                                 "calibrate_s": time.perf_counter() - t0}
    return [(f"long-cal{seq}", scheme)]


def v_channel(m: Model, args, name: str):
    from oscar_calib.experimental.channel import ChannelScheme

    return [(name, ChannelScheme.of(m.zoo, block=m.zoo.group_size, rotate=name != "channel-kivi",
                                    clip=name == "channel-clip", name=name))]


# name (before any "=") -> builder(model, args, name) -> [(row name, scheme)]
VARIANTS = {"bf16": v_bf16, "hadamard": v_hadamard, "zoo": v_zoo, "gain": v_gain, "window": v_window,
            "long-cal": v_long_cal, "channel": v_channel, "channel-kivi": v_channel, "channel-clip": v_channel}


def int2_keys(scheme, length: int, scored: int) -> float:
    """Mean INT2 keys a scored query reads in a full-attention layer (every key but the sink and its
    recent window)."""
    first = length - 1 - scored
    return sum(max(0, i + 1 - scheme.sink - scheme.recent) for i in range(first, length - 1)) / scored


def score(m: Model, scheme, windows, scored, real: bool = False) -> tuple[float, int]:
    """Summed NLL and predictions over ``windows``: the simulation, or (``real``) OscarCache."""
    from oscar_calib.eval import real_cache_nll, sequence_nll

    nll = n = 0
    for w in windows:
        a, b = (real_cache_nll if real else sequence_nll)(m.lm.model, w.unsqueeze(0), scheme, scored=scored)
        nll, n = nll + a, n + b
    return nll, n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", default=[], metavar="ALIAS[=PATH]",
                    help="a zoo alias, optionally loaded from PATH (repeatable)")
    ap.add_argument("--lengths", action="append", default=[], metavar="ALIAS=L1,L2",
                    help="context lengths per model (default 8192)")
    ap.add_argument("--tokenizer", action="append", default=[], metavar="ALIAS=DIR",
                    help="load ALIAS's tokenizer from a saved folder")
    ap.add_argument("--artifact", action="append", default=[], metavar="ALIAS=DIR",
                    help="the artifact of ALIAS (default zoo/ALIAS)")
    ap.add_argument("--config", action="append", default=[], metavar="ALIAS=YAML",
                    help="the recipe long-cal re-calibrates with (default configs/ALIAS.yaml)")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated, of {', '.join(VARIANTS)} "
                    "(gain=A, window=S+R take a value)")
    ap.add_argument("--gains", default=GAINS, help="gains of the gain variant")
    ap.add_argument("--window", default="128+2048", help="sink+recent of the window variant")
    ap.add_argument("--cal-seq-len", type=int, default=0, help="long-cal's sequence length (0: 8192, or 16384 above "
                    "16K)")
    ap.add_argument("--cal-heldout", type=int, default=4096, help="long-cal's held-out rows")
    ap.add_argument("--texts", default="embedded", help="held-out texts (embedded, embedded-code or files)")
    ap.add_argument("--sequences", type=int, default=1, help="windows per length")
    ap.add_argument("--scored", default="", help="predictions scored per window (default: eval's rule, 1,024; "
                    "'all': every one)")
    ap.add_argument("--real-cache", default="", metavar="ROWS",
                    help="comma-separated rows (e.g. zoo,hadamard) also scored through OscarCache itself "
                         "(oscar_calib.eval.real_cache_nll: one decode step per scored prediction), a ppl_real "
                         "column; rows it cannot store are named")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32", help="weights' dtype (the simulation computes in float32)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--render", type=Path, nargs="+", default=[], metavar="JSON",
                    help="measure nothing: write each result's table (.md beside it) and the docs' figures "
                         f"({FIGURES.relative_to(ROOT)}/) again from the JSON (a run writes its figures beside --out)")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if args.render:
        for path in args.render:
            render(json.loads(path.read_text()), path, FIGURES)
        return

    import torch
    from harness import describe_device, git_commit, versions

    from oscar_calib.eval import context_windows
    from oscar_calib.eval.options import scored_predictions
    from oscar_calib.fsutil import atomic_write_text
    from oscar_calib.runtime.cache import not_storable
    from oscar_calib.runtime.compat import layer_windows
    from oscar_calib.runtime.storage import context_bits

    if not args.model:
        raise SystemExit("error: give at least one --model ALIAS[=PATH]")
    paths = {k: (v or None) for k, v in (m.partition("=")[::2] for m in args.model)}
    lengths = {k: [int(x) for x in v.split(",")] for k, v in _pairs(args.lengths, "--lengths").items()}
    tokenizers, artifacts = _pairs(args.tokenizer, "--tokenizer"), _pairs(args.artifact, "--artifact")
    recipes = _pairs(args.config, "--config")
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in names if v.partition("=")[0] not in VARIANTS]
    if bad:
        raise SystemExit(f"error: unknown variant(s) {', '.join(bad)}; choose from {', '.join(VARIANTS)}")
    texts = [t.strip() for t in args.texts.split(",") if t.strip()]
    real_rows = {v.strip() for v in args.real_cache.split(",") if v.strip()}
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    args.device = device
    out = args.out or ROOT / "runs" / "long_levers.json"
    dev = describe_device(cuda=device.startswith("cuda"))
    result = {"benchmark": "long_levers", "device": dev.slug, "device_name": dev.name, "commit": git_commit(),
              "command": "python scripts/experiments/long_levers.py " + " ".join(argv), "versions": versions(),
              "settings": {"variants": names, "gains": args.gains, "window": args.window, "texts": texts,
                           "sequences": args.sequences, "scored": args.scored or "eval's rule", "dtype": args.dtype},
              "models": {}, "rows": []}

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps(result, indent=2, sort_keys=True) + "\n")

    t_all = time.perf_counter()
    for alias, path in paths.items():
        t0 = time.perf_counter()
        lm = load(alias, path, tokenizers.get(alias), device, args.dtype)
        art, zoo = zoo_scheme(lm, Path(artifacts.get(alias, ROOT / "zoo" / alias)))
        m = Model(alias, lm, zoo, art, layer_windows(lm.model.config), lengths.get(alias, [8192]),
                  Path(recipes.get(alias, ROOT / "configs" / f"{alias}.yaml")))
        result["models"][alias] = {"model_id": lm.source.model_id, "lengths": m.lengths, "load_s": time.perf_counter() - t0,
                                   "artifact": str(artifacts.get(alias, f"zoo/{alias}"))}
        schemes = []
        for name in names:
            t1 = time.perf_counter()
            built = VARIANTS[name.partition("=")[0]](m, args, name)
            schemes += built
            print(f"{alias}: {', '.join(n for n, _ in built)} built in {time.perf_counter() - t1:.1f} s", flush=True)
        result["models"][alias]["variants"] = m.extra
        for text in texts:
            for length in m.lengths:
                scored = (None if args.scored == "all" else int(args.scored) if args.scored
                          else scored_predictions(length))
                wins = context_windows(lm.tokenizer, length, sequences=args.sequences, data=text)
                n_scored = scored if scored is not None else length - 1
                base = None
                for row_name, sch in schemes:
                    t1 = time.perf_counter()
                    nll, n = score(m, sch, wins, scored)
                    ppl = math.exp(nll / n)
                    if row_name == "bf16":
                        base = ppl
                    row = {"model": alias, "text": text, "length": length, "variant": row_name, "ppl": ppl,
                           "tokens": n, "scored": n_scored, "bits_per_element": sch.bits_per_element,
                           "bits_at_context": context_bits(sch, m.windows, length),
                           "int2_keys": int2_keys(sch, length, n_scored) if sch.quantized else 0.0,
                           "sink": sch.sink, "recent": sch.recent, "logit_correction": sch.logit_correction,
                           "seconds": time.perf_counter() - t1}
                    if base is not None:
                        row["vs_bf16"] = ppl / base - 1
                    if row_name in real_rows:
                        why = not_storable(sch)
                        if why:
                            row["real_cache"] = why
                        else:
                            t2 = time.perf_counter()
                            nll, n = score(m, sch, wins, scored, real=True)
                            row.update(ppl_real=math.exp(nll / n), real_seconds=time.perf_counter() - t2)
                    result["rows"].append(row)
                    result["total_s"] = time.perf_counter() - t_all
                    save()
                    real = f"; real cache {row['ppl_real']:.3f}" if "ppl_real" in row else ""
                    print(f"{alias} {text} {length}: {row_name} {ppl:.3f}{real} ({row['seconds']:.1f} s)", flush=True)
        del m, lm
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    render(result, out, out.parent)
    print(table(result))


FIGURES = ROOT / "docs" / "img" / "levers"
# the variants a figure draws (Hadamard is off their scale: the tables hold it), in this order
FIGURE_VARIANTS = ("zoo", "gain=0", "gain=1", "long-cal", "window", "channel-kivi")


def figure_name(result: dict, alias: str) -> str:
    return f"{alias}-{result['device']}.svg"


def render(result: dict, out: Path, figures: Path) -> list[Path]:
    """Write ``out``'s table (``.md`` beside it) and, for every model measured at two lengths or
    more, its figure (:func:`figure`) in ``figures`` (a run: beside ``out``; ``--render``: the
    docs' :data:`FIGURES`); returns the figures written."""
    from oscar_calib.fsutil import atomic_write_text

    atomic_write_text(out.with_suffix(".md"), table(result) + "\n")
    written = []
    for alias in dict.fromkeys(r["model"] for r in result["rows"]):
        svg = figure(result, alias)
        if svg:
            figures.mkdir(parents=True, exist_ok=True)
            atomic_write_text(figures / figure_name(result, alias), svg)
            written.append(figures / figure_name(result, alias))
    return written


def figure(result: dict, alias: str) -> str | None:
    """One model's perplexity over BF16 (%) against context length, one panel per text, a line per
    variant of :data:`FIGURE_VARIANTS` (by name prefix; ``bits with windows`` in the legend where
    the variant holds more than the zoo artifact); None below two lengths."""
    from plots import CATEGORY_COLOURS, _legend, _panel, _svg

    rows = [r for r in result["rows"] if r["model"] == alias and r["variant"] != "bf16" and "vs_bf16" in r]
    lengths = sorted({r["length"] for r in rows})
    if len(lengths) < 2:
        return None
    names = [v for p in FIGURE_VARIANTS for v in dict.fromkeys(r["variant"] for r in rows)
             if v == p or v.startswith(p + "=") or (p == "long-cal" and v.startswith(p))]
    zoo_bits = {r["length"]: r["bits_at_context"] for r in rows if r["variant"] == "zoo"}
    texts = list(dict.fromkeys(r["text"] for r in rows))
    width, panel_w, panel_h = 70 + 370 * len(texts) + 270, 280, 220
    body, series = [], []
    for i, text in enumerate(texts):
        series = []
        for j, v in enumerate(names):
            sel = {r["length"]: r for r in rows if r["text"] == text and r["variant"] == v}
            more = [f"{sel[n]['bits_at_context']:.1f}" for n in lengths
                    if n in sel and sel[n]["bits_at_context"] > zoo_bits.get(n, 0) + 1e-6]
            label = v + (f" ({'/'.join(more)} bits)" if more else "")
            series.append({"name": label, "colour": CATEGORY_COLOURS[j % len(CATEGORY_COLOURS)],
                           "dash": j >= len(CATEGORY_COLOURS),
                           "ys": [100 * sel[n]["vs_bf16"] if n in sel else None for n in lengths]})
        body += _panel(70 + 370 * i, 50, panel_w, panel_h, text, lengths, series, "% over BF16 perplexity")
    body += _legend(40 + 370 * len(texts), 60, series)
    return _svg(width, 310, f"{alias}: long-window levers, {result['device_name']}", body)


def table(result: dict) -> str:
    """The rows as one markdown table per model and text, and each length's best gain."""
    lines = [f"long_levers on {result['device_name']} at {result['commit']}: perplexity of the last predictions of "
             f"{result['settings']['sequences']} window(s) per length, simulation (= the real cache)", ""]
    rows = result["rows"]
    for alias, text in dict.fromkeys((r["model"], r["text"]) for r in rows):
        sel = [r for r in rows if r["model"] == alias and r["text"] == text]
        lens = sorted({r["length"] for r in sel})
        lines += [f"{alias}, {text}:", "",
                  "| variant | bits (history) | " + " | ".join(f"{n:,}: ppl (vs BF16) · bits with windows"
                                                               for n in lens) + " |",
                  "|---|---|" + "---|" * len(lens)]
        for v in dict.fromkeys(r["variant"] for r in sel):
            cells = []
            for n in lens:
                r = next((x for x in sel if x["variant"] == v and x["length"] == n), None)
                rel = f" ({r['vs_bf16']:+.2%})" if r and "vs_bf16" in r and v != "bf16" else ""
                real = f"; real cache {r['ppl_real']:.3f}" if r and "ppl_real" in r else ""
                cells.append(f"{r['ppl']:.3f}{rel}{real} · {r['bits_at_context']:.2f}" if r else "–")
            first = next(x for x in sel if x["variant"] == v)
            lines.append(f"| {v} | {first['bits_per_element']:.3f} | " + " | ".join(cells) + " |")
        best = []
        for n in lens:
            gains = [r for r in sel if r["length"] == n and r["variant"].startswith("gain=")]
            zoo = next((r for r in sel if r["length"] == n and r["variant"] == "zoo"), None)
            cand = gains + ([zoo] if zoo else [])
            if cand:
                b = min(cand, key=lambda r: r["ppl"])
                best.append(f"{n:,} ({b['int2_keys']:,.0f} INT2 keys per query): gain {b['logit_correction']:g}")
        if best:
            lines += ["", "best logit-correction gain: " + "; ".join(best)]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
