#!/usr/bin/env python
"""Key centering measured: a recipe calibrated without and with ``--center-keys`` (and, with it, the
``ktk`` key objective of the raw keys instead of the centered ones), derived artifacts that isolate
one step each, then ``oscar eval``'s held-out perplexity (``--methods bf16,oscar``) and ``oscar
verify``'s attention error of each artifact, and what centering does to the stored rows.

    python scripts/experiments/centering.py configs/smollm2-135m.yaml \
        --out scripts/experiments/results/centering_smollm2-135m.json         # also writes the .md beside it
    python scripts/experiments/centering.py configs/gemma3-270m.yaml --long 0 \
        --out scripts/experiments/results/centering_gemma3-270m.json

========================  ====================================================================
variant                   artifact (everything else the recipe's)
========================  ====================================================================
``plain``                 the recipe as it is (keys stored raw)
``center``                ``center_keys: true``: keys stored centered on the calibration's mean key,
                          the ``ktk`` objective and the clips fitted on the centered keys
``center-raw-ktk``        ``center_keys: true`` with the ``ktk`` objective of the raw keys
                          (``calibration.shared.CENTER_KEY_OBJECTIVE`` off): the clips still fitted centered
``center noclip``         ``center`` with every key clip ratio 1 (``--clip k=1``: the values' clips fitted)
``center plain-groups``   ``center`` with ``plain``'s per-layer group sizes instead of a bit budget
                          spent on centered keys (recipes with ``bit_budget``; needs ``plain``)
``plain+mean``            ``center_keys: true`` with ``center_fit: raw``: ``plain``'s rotations, clips and
                          group sizes with the calibration's key means added: centering alone, nothing
                          fitted for it
``plain lc0``             ``plain`` scored without the logit-noise correction (``--logit-correction 0``)
``plain+mean lc0``        ``plain+mean`` likewise
``plain recent16``        ``plain`` scored with a BF16 recent window of 16 tokens (``--recent 16``)
``plain+mean recent16``   ``plain+mean`` likewise
``plain+mean+clips``      ``plain+mean`` with the key clips of ``center plain-groups`` (fitted on
                          centered keys at ``plain``'s group sizes): the clip refit alone (needs both)
``plain noclip``          ``plain`` with every key clip ratio 1 (no key clip)
``plain+mean noclip``     ``plain+mean`` likewise
========================  ====================================================================

A run with ``--variants`` keeps the rows of the other variants already in ``--out`` (and its BF16
figures), so variants can be added one run at a time; a derived variant needs the artifacts it is
derived from in ``runs/centering/MODEL/``. The scored-only variants (``lc0``, ``recent16``) and the derived
no-clip ones are not verified (their verify columns read "–").

Each variant is scored on ``--sequences`` × ``--seq-len`` held-out tokens of every text of
``--texts`` (BF16 sink and recent window, INT2 history: the perplexity simulation, which is the
real cache's arithmetic) and, with ``--long N``, on one N-token sequence of the first text; verify
runs at its default depths on the corpus' other held-out half. ``rows`` (with ``plain`` and
``center`` present) records, over the first held-out sequence of the first text and every layer and
KV head: the share of the keys' energy in the calibration's mean key, how evenly ``plain``'s key
rotation spreads that mean over the channels (the largest ``|μR|`` over ``|μ|/√d``; 1 = evenly), and
the median range (max − min) of a stored row rotated by ``plain``'s rotation, raw and centered:
what centering takes out of each INT2 group's range. A row of a bit-budget recipe records the budget's
bits (mean and long-context) and held-out figure. Artifacts go to ``runs/centering/MODEL/VARIANT``.
Runs on the CPU (nice it on a shared machine); the time of every stage is recorded.

Where the mean is taken (``--collect-context RUNS --prefix P``): the mean key of post-RoPE keys
depends on the positions it is taken over (RoPE's slow channels turn with position), so a mean
from the recipe's 1,024-token windows is not the mean of the keys an 8K cache holds. These
variants are made with the CLI and scored with ``oscar eval`` at 2 × 2048 tokens (``--sequences
2``) and at ``--context 8192 --sequences 1``; this mode reads those ``--json`` outputs
(``RUNS/P_VARIANT_2k.json``, ``RUNS/P_VARIANT_8k.json``, ``RUNS/P_VARIANT_code8k.json`` with
``--data embedded-code``; ``plain``'s with ``--methods bf16,oscar``, the others ``--methods oscar``) and each artifact's ``calibration.json``, and stores the table in
``--out`` under ``context`` (kept by later runs of the variants above):

=====================  ==========================================================================
variant                artifact
=====================  ==========================================================================
``plain``              the recipe (the zoo artifact, ``oscar calibrate MODEL --config C``)
``raw``                ``--center-keys --center-fit raw``: ``plain`` with the mean key added
``raw mean@4096``      ``raw`` with the key means of a calibration at ``--seq-len 4096``
                       (``--with-means-of``)
``raw mean@8192``      ``raw`` with the key means of a calibration at ``--seq-len 8192 --tokens 8192``
``raw @8192``          ``--center-keys --center-fit raw --seq-len 8192 --tokens 8192``: the whole
                       recipe on one 8,192-token window
``plain @8192``        ``--seq-len 8192 --tokens 8192``, uncentered
=====================  ==========================================================================

``--with-means-of BASE MEANS OUT`` writes BASE's artifact with MEANS' key means (both centered).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# calibrated: (center_keys, centered ktk objective[, the variant whose group sizes it keeps[, config settings]]);
# derived: ("derive", base, key clip off[, key clips from]);
# scored only: ("score", artifact variant, EvalOptions settings)
VARIANTS = {
    "plain": (False, True), "center": (True, True), "center-raw-ktk": (True, False),
    "center noclip": (True, True, None, {"k_clip": 1.0}),
    "center plain-groups": (True, True, "plain"),
    "plain+mean": (True, True, None, {"center_fit": "raw"}),
    "plain+mean+clips": ("derive", "plain+mean", False, "center plain-groups"),
    "plain lc0": ("score", "plain", {"logit_correction": 0.0}),
    "plain+mean lc0": ("score", "plain+mean", {"logit_correction": 0.0}),
    "plain recent16": ("score", "plain", {"recent": 16}), "plain+mean recent16": ("score", "plain+mean", {"recent": 16}),
    "plain noclip": ("derive", "plain", True), "plain+mean noclip": ("derive", "plain+mean", True),
}


# the context table's variants: (artifact directory under RUNS as P_NAME, or None: the zoo's; eval file stem)
CONTEXT_VARIANTS = {"plain": (None, "plain"), "raw": ("raw1024", "raw1024"),
                    "raw mean@4096": ("raw1024_mean4096", "raw1024_mean4096"),
                    "raw mean@8192": ("raw1024_mean8192", "raw1024_mean8192"),
                    "raw @8192": ("raw8192", "raw8192"), "plain @8192": ("plain8192", "plain8192")}


def main(argv=None) -> None:
    if argv is None and sys.argv[1:2] == ["--with-means-of"]:
        if len(sys.argv) != 5:
            raise SystemExit("usage: centering.py --with-means-of BASE MEANS OUT")
        with_means_of(*map(Path, sys.argv[2:]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config", type=Path, help="a recipe YAML (its calibration: section)")
    ap.add_argument("--collect-context", type=Path, metavar="RUNS", help="store the mean-window table from the "
                    "oscar eval outputs in RUNS (the module docstring) and stop")
    ap.add_argument("--prefix", default="", help="with --collect-context: the runs' name prefix")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--texts", default="embedded", help="comma-separated eval texts (embedded, embedded-code, a file)")
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--long", type=int, default=8192, help="one sequence of this many tokens (0: none)")
    ap.add_argument("--out", type=Path, required=True, help="the result JSON (a .md table is written beside it)")
    ap.add_argument("--reuse", action="store_true", help="a variant already in --out with its artifact in runs/: "
                    "only the texts (and --long) it was not scored on yet")
    ap.add_argument("--no-verify", dest="verify", action="store_false", help="skip oscar verify (its columns read –)")
    args = ap.parse_args(argv)
    if args.collect_context:
        collect_context(args)
        return
    import torch

    from oscar_calib.calibration import pipeline, shared
    from oscar_calib.contract.artifact import load_artifact
    from oscar_calib.contract.config import config_from_options
    from oscar_calib.eval.verify import verify_artifact
    from oscar_calib.model.load import load_model

    torch.manual_seed(0)
    base = config_from_options(args.config, {"device": "cpu"})
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"error: unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    texts = [t.strip() for t in args.texts.split(",") if t.strip()]
    t0 = time.perf_counter()
    lm = load_model(base.model, device="cpu", dtype=base.dtype)
    timings = {"load_s": time.perf_counter() - t0}
    name = Path(base.model).name
    old = json.loads(args.out.read_text()) if args.out.exists() else {"rows": [], "bf16": {}}
    for r in old["rows"]:           # rows written before the "eval" settings were recorded
        gain = r.pop("eval_logit_correction", None)
        r.setdefault("eval", {} if gain is None else {"logit_correction": gain})
    rows, bf16 = [r for r in old["rows"] if r["variant"] not in variants], dict(old["bf16"])
    runs = ROOT / "runs" / "centering" / name
    done = {r["variant"]: r for r in old["rows"]}
    for v in variants:
        spec = VARIANTS[v]
        scored_only = spec[0] == "score"
        out = runs / (spec[1] if scored_only else v)
        over = spec[2] if scored_only else {}
        if args.reuse and v in done and (out / "oscar.safetensors").exists():
            row, art = done[v], load_artifact(out)
            score(row, art, lm, texts, args, bf16, over)
            rows.append(row)
            continue
        t1 = time.perf_counter()
        if scored_only:
            center = centered_objective = None
            if not (out / "oscar.safetensors").exists():
                raise SystemExit(f"error: {v} scores {out}, which is not there: run the variant {spec[1]!r} first")
        elif spec[0] == "derive":
            centered_objective = False
            derive(runs / spec[1], out, no_key_clip=spec[2], clips=runs / spec[3] if len(spec) > 3 else None)
        else:
            center, centered_objective, keep, settings = (*spec, *(None, {})[len(spec) - 2:])
            centered_objective = centered_objective and settings.get("center_fit", "centered") == "centered"
            cfg = base.__class__(**{**base.to_dict(), "center_keys": center, **settings})
            shared.CENTER_KEY_OBJECTIVE = centered_objective
            with groups_of(runs / keep if keep else None):
                pipeline.calibrate(cfg, out, overwrite=True, loaded=lm)
            shared.CENTER_KEY_OBJECTIVE = True
        t2 = time.perf_counter()
        art = load_artifact(out)
        row = {"variant": v, "center_keys": art.settings.key_centering,
               "centered_objective": bool(centered_objective and art.settings.key_centering), "eval": over,
               "verify_attn": None, "verify_attn_hadamard": None, "verify_logit": None, "ppl": {},
               "times_s": {"build": t2 - t1}}
        if args.verify and not scored_only and not (spec[0] == "derive" and spec[2]):
            verdict = verify_artifact(out, loaded=lm, write=False, plot=False).summary()
            row.update(verify_attn=verdict["mean_attn_error"], verify_attn_hadamard=verdict["mean_attn_error_hadamard"],
                       verify_logit=verdict["mean_logit_error"])
            row["times_s"]["verify"] = time.perf_counter() - t2
        score(row, art, lm, texts, args, bf16, over)
        rows.append(row)
        print(json.dumps(row), flush=True)
    rows.sort(key=lambda r: list(VARIANTS).index(r["variant"]))
    for r in rows:                  # a bit budget's choice, from the artifact's report
        rep = runs / r["variant"] / "calibration.json"
        budget = json.loads(rep.read_text()).get("bit_budget") if rep.exists() else None
        if budget:
            r["bit_budget"] = {k: budget[k] for k in ("mean_bits", "long_bits", "heldout_attn")}
    result = {"model_id": lm.source.model_id, "config": str(args.config), "bf16": bf16, "rows": rows,
              "settings": {"sequences": args.sequences, "seq_len": args.seq_len, "texts": texts, "long": args.long,
                           "threads": torch.get_num_threads()},
              "timings": timings}
    if (runs / "plain" / "oscar.safetensors").exists() and (runs / "center" / "oscar.safetensors").exists():
        t3 = time.perf_counter()
        result["rows_stored"] = stored_rows(lm, load_artifact(runs / "plain"), load_artifact(runs / "center"), texts[0])
        timings["rows_stored_s"] = time.perf_counter() - t3
    timings["total_s"] = time.perf_counter() - t0
    if old.get("context"):
        result["context"] = old["context"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(render(result))
    print(render(result))


def score(row: dict, art, lm, texts: list[str], args, bf16: dict, over: dict | None = None) -> None:
    """Perplexity of ``art`` on every text (and at ``--long``) ``row`` has no figure for yet; BF16 once
    per text; ``over``: :class:`EvalOptions` settings instead of the defaults (the artifact's logit-noise
    correction, the recipe's windows)."""
    from oscar_calib.eval import EvalOptions, evaluate_ppl

    jobs = [(t, t, args.sequences, args.seq_len) for t in texts]
    if args.long:
        jobs.append((f"{texts[0]}@{args.long}", texts[0], 1, args.long))
    for key, text, n, length in jobs:
        if key in row["ppl"]:
            continue
        t0 = time.perf_counter()
        methods = "oscar" if key in bf16 else "bf16,oscar"
        res = evaluate_ppl(lm, EvalOptions(methods=methods, sequences=n, seq_len=length, data=text, **(over or {})),
                           artifact=art)
        got = {r["method"]: r["ppl"] for r in res.rows}
        bf16.setdefault(key, got.get("bf16"))
        row["ppl"][key] = got["oscar"]
        row["times_s"][f"eval {key}"] = time.perf_counter() - t0
        print(json.dumps({"variant": row["variant"], key: got}), flush=True)


@contextlib.contextmanager
def groups_of(artifact: Path | None):
    """Within: the bit budget's allocation replaced by ``artifact``'s per-layer group sizes (None:
    unchanged), its bits and held-out figures counted from the same tables."""
    from oscar_calib.calibration import budget
    from oscar_calib.contract.artifact import load_artifact

    if artifact is None:
        yield
        return
    st = load_artifact(artifact).settings
    want = [(g.k, g.v) for g in st.layer_groups]
    spend = budget.allocate

    def allocate(tables, sizes, bits, *, tied=True, long_layers=None):
        spend(tables, sizes, bits, tied=tied, long_layers=long_layers)          # the budget's own checks
        ik, iv = [sizes.index(k) for k, _ in want], [sizes.index(v) for _, v in want]
        longs = list(range(len(tables))) if not long_layers else list(long_layers)
        return budget.Allocation(groups=list(want), mean_bits=budget._bits(sizes, ik + iv),
                                 long_bits=budget._bits(sizes, [ik[i] for i in longs] + [iv[i] for i in longs]),
                                 heldout_mse=sum(float(t[a, b] ** 2) for t, a, b in zip(tables, ik, iv)))

    budget.allocate = allocate
    try:
        yield
    finally:
        budget.allocate = spend


def derive(base: Path, out: Path, *, no_key_clip: bool = False, clips: Path | None = None) -> None:
    """``base``'s artifact with every key clip ratio 1 with ``no_key_clip``, the key clips of ``clips``
    (same group sizes) when given; written to ``out``."""
    import torch

    from oscar_calib.contract.artifact import load_artifact, write_artifact_files

    a = load_artifact(base)
    what = []
    if clips is not None:
        c = load_artifact(clips)
        if c.settings.layer_groups != a.settings.layer_groups or c.settings.group_size != a.settings.group_size:
            raise SystemExit(f"error: {clips} has other group sizes than {base}: its clips do not fit them")
        for la, lc in zip(a.layers, c.layers):
            la.k_clip = lc.k_clip
        what.append(f"{clips.name}'s key clips")
    if no_key_clip:
        for la in a.layers:
            la.k_clip = torch.ones_like(la.k_clip)
        what.append("no key clip")
    out.mkdir(parents=True, exist_ok=True)
    write_artifact_files(out, a, f"{base.name}'s rotations and clips with {' and '.join(what)}\n", a.report)


def with_means_of(base: Path, means: Path, out: Path) -> None:
    """``base``'s artifact (centered) with the key means of ``means`` (centered, same model), written
    to ``out``: the same rotations, clips and group sizes, a mean taken over other windows."""
    from oscar_calib.contract.artifact import load_artifact, write_artifact_files

    a, m = load_artifact(base), load_artifact(means)
    if not (a.settings.key_centering and m.settings.key_centering) or a.model_fingerprint != m.model_fingerprint:
        raise SystemExit(f"error: {base} and {means} must both be centered artifacts of one model")
    for la, lm_ in zip(a.layers, m.layers):
        la.k_mean = lm_.k_mean
    out.mkdir(parents=True, exist_ok=True)
    write_artifact_files(out, a, f"{base.name}'s artifact with the key means of {means.name}\n", a.report)


# the context table's columns: eval file suffix -> column (text, tokens of context)
CONTEXT_COLUMNS = {"2k": "embedded 2 × 2,048", "8k": "embedded 8,192", "code8k": "embedded-code 8,192"}


def collect_context(args) -> None:
    """The mean-window table (module docstring) from ``oscar eval --json`` outputs, into ``--out``."""
    from oscar_calib.contract.config import load_yaml_section

    runs, p = args.collect_context, f"{args.prefix}_" if args.prefix else ""
    zoo = ROOT / "zoo" / load_yaml_section(args.config)["model"]
    old = json.loads(args.out.read_text())
    bf16, rows = {}, []
    for name, (art, stem) in CONTEXT_VARIANTS.items():
        row = {"variant": name, "ppl": {}, "bits": None, "long_bits": None}
        for suffix, column in CONTEXT_COLUMNS.items():
            f = runs / f"{p}{stem}_{suffix}.json"
            if not f.exists() or not f.stat().st_size:      # not run, or still running
                continue
            for r in json.loads(f.read_text())["rows"]:
                if r["method"] == "bf16":
                    bf16[column] = r["ppl"]
                elif r["method"] == "oscar":
                    row["ppl"][column] = r["ppl"]
                    row["bits"] = r["bits_per_element"]
        rep = (runs / f"{p}{art}" if art else zoo) / "calibration.json"
        if rep.exists():
            report = json.loads(rep.read_text())
            row["long_bits"] = (report.get("bit_budget") or {}).get("long_bits")
            row["seq_len"] = report["settings"]["seq_len"]
        if row["ppl"]:
            rows.append(row)
    old["context"] = {"bf16": bf16, "rows": rows, "columns": [c for c in CONTEXT_COLUMNS.values() if c in bf16]}
    args.out.write_text(json.dumps(old, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(render(old))
    print(render(old))


def stored_rows(lm, plain, centered, text: str) -> dict:
    """What centering does to the rows INT2 stores (see the module docstring), over the first held-out
    sequence of ``text``: means over every layer and KV head. ``int2_logit_bias``: per query, the
    mean error of its logits over the keys INT2 holds (``scaling · q·(k̂ − k)``, the queries from
    token 1024 on and their keys from 64 to 768, ``plain``'s rotations, clips and key group sizes),
    averaged over queries, heads and layers, raw and centered: a shift of every INT2 logit against
    the BF16 window, which softmax does not cancel."""
    import torch

    from oscar_calib.eval.ppl import heldout_sequences
    from oscar_calib.kernels import quantize_kv
    from oscar_calib.model.capture import Capture, capture_forward

    ids = heldout_sequences(lm.tokenizer, sequences=1, seq_len=2048, data=text, seed=0)[0]
    rows = {}

    def keep(layer, module, q, k, v, o, kw):
        rows[layer] = (q[0].float(), k[0].float(), float(module.scaling))     # [Hq, T, d], [H, T, d]

    with torch.no_grad(), Capture(lm.model, [keep]):
        capture_forward(lm.model, ids.unsqueeze(0).to(lm.model.device))
    st = plain.settings
    out = {n: [] for n in ("share", "spread", "raw", "centered", "bias_raw", "bias_centered")}
    for i, (q, k, scaling) in sorted(rows.items()):
        lp = plain.layers[i]
        r, mu = lp.k_rotation.float(), centered.layers[i].k_mean.float()
        y = torch.einsum("htd,hde->hte", k, r)
        m = torch.einsum("hd,hde->he", mu, r)
        out["share"] += (mu.pow(2).sum(-1) / k.pow(2).sum(-1).mean(-1)).tolist()
        out["spread"] += (m.abs().amax(-1) / (mu.norm(dim=-1) / k.shape[-1] ** 0.5)).tolist()
        out["raw"] += (y.amax(-1) - y.amin(-1)).median(-1).values.tolist()
        yc = y - m[:, None]
        out["centered"] += (yc.amax(-1) - yc.amin(-1)).median(-1).values.tolist()
        g = st.layer_groups[i].k if st.layer_groups else st.group_size
        qs, grp = q[:, 1024::8], q.shape[0] // k.shape[0]
        for name, shift in (("bias_raw", None), ("bias_centered", m)):
            x = k.transpose(0, 1).to(torch.bfloat16)                                  # [T, H, d] as stored
            kq = quantize_kv(x, r, lp.k_clip.float(), g, center=shift, backend="torch").dequantize()
            kh = torch.einsum("the,hde->htd", kq, r) + (0 if shift is None else mu[:, None])
            err = (kh - x.transpose(0, 1).float()).repeat_interleave(grp, 0)[:, 64:768]
            out[name] += (scaling * torch.einsum("hnd,htd->hnt", qs, err)).mean(-1).mean(-1).tolist()
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"tokens": int(ids.numel()), "mean_energy_share": mean(out["share"]), "mean_spread": mean(out["spread"]),
            "median_row_range_raw": mean(out["raw"]), "median_row_range_centered": mean(out["centered"]),
            "int2_logit_bias_raw": mean(out["bias_raw"]), "int2_logit_bias_centered": mean(out["bias_centered"])}


def render(result: dict) -> str:
    """The result as a Markdown table: perplexity per text (and its gap to BF16), verify's errors."""
    keys = list(result["bf16"])
    head = ["variant", *[f"ppl {k} (BF16 {result['bf16'][k]:.3f})" for k in keys], "verify attn err", "verify logit err"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    fmt = lambda x: "–" if x is None else f"{x:.4f}"  # noqa: E731
    for r in result["rows"]:
        cells = [f"{r['ppl'][k]:.3f} ({100 * (r['ppl'][k] / result['bf16'][k] - 1):+.2f}%)" if k in r["ppl"] else "–"
                 for k in keys]
        lines.append(f"| {r['variant']} | " + " | ".join(cells) + f" | {fmt(r['verify_attn'])} | {fmt(r['verify_logit'])} |")
    text = f"{result['model_id']} ({result['config']})\n\n" + "\n".join(lines) + "\n"
    s = result.get("rows_stored")
    if s:
        text += (f"\nStored rows ({s['tokens']} tokens, mean over layers and KV heads): the mean key holds "
                 f"{100 * s['mean_energy_share']:.0f}% of the keys' energy; plain's rotation spreads it to "
                 f"{s['mean_spread']:.2f}× the even share per channel; median row range raw "
                 f"{s['median_row_range_raw']:.3f}, centered {s['median_row_range_centered']:.3f}; mean INT2 logit bias "
                 f"raw {s['int2_logit_bias_raw']:+.3f}, centered {s['int2_logit_bias_centered']:+.3f}.\n")
    c = result.get("context")
    if c:
        cols = c["columns"]
        head = ["variant", *[f"ppl {col} (BF16 {c['bf16'][col]:.3f})" for col in cols],
                "bits per element (full-attention layers)"]
        text += ("\nWhere the mean is taken: `oscar eval`, 2 × 2048 tokens (every position) and the last 1,024 "
                 "predictions of one 8,192-token window (simulation = the real cache's arithmetic)\n\n"
                 + "| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n")
        for r in c["rows"]:
            cells = ["–" if col not in r["ppl"] else f"{r['ppl'][col]:.3f} ({100 * (r['ppl'][col] / c['bf16'][col] - 1):+.2f}%)"
                     for col in cols]
            bits = "–" if r["bits"] is None else f"{r['bits']:.3f}" + (
                "" if r.get("long_bits") is None else f" ({r['long_bits']:.3f})")
            text += f"| {r['variant']} | " + " | ".join(cells) + f" | {bits} |\n"
    return text


if __name__ == "__main__":
    main()
