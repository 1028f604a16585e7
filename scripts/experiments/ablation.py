#!/usr/bin/env python
"""Ablation of the calibration options, measured as held-out perplexity with a 2-bit KV cache.

    python scripts/experiments/ablation.py smollm2-135m            # -> runs/ablation/smollm2-135m.json + a table
    python scripts/experiments/ablation.py gemma3-270m
    python scripts/experiments/ablation.py smollm2-135m --variants default,layer,clip-fixed --sequences 1
    python scripts/experiments/ablation.py smollm2-135m --variants default,refine --threads 1 \
        --out scripts/experiments/results/ablation_refine_smollm2-135m.json   # also writes the .md beside it
    python scripts/experiments/ablation.py --render --out scripts/experiments/results/ablation_budget_gemma3-270m.json \
        --niah budget=scripts/experiments/results/niah_gemma3-270m_budget_h100.json:oscar   # a NIAH column, no model

One set of statistics is collected (``oscar calibrate``'s defaults: 8192 tokens of the embedded
corpus' calibration half, sequences of 1024, seed 0) and cached in ``runs/ablation/MODEL.stats.pt``;
every variant re-runs only the rotation and clip step (``calibration.fit.build_rotations``) with its
options changed, and is scored by ``oscar eval``'s perplexity (``eval.nll.sequence_nll``: 2 × 2048
held-out tokens, BF16 sink 64 + recent 256 per query position, INT2 history) on every text of
``--texts``: by default the embedded corpus' held-out half (``embedded``, CPython's documentation
topics) and the embedded code corpus' held-out half (``embedded-code``, stdlib source: a second
domain nothing is calibrated on). Baselines use the same sink, window and group size: BF16, naive
INT2 (no rotation, no clip) and Hadamard (QuaRot-INT2, clips 0.96/0.92).

Variants (each changes one option of the default, or names a combination):

=================  ========================================================================
variant            options
=================  ========================================================================
``default``        ``CalibrationConfig()``: ktk, sst, u_h_pbr, per KV head, fitted clips,
                   G = min(128, head_dim)
``published``      the reference recipe: one rotation per layer, qqt, sst-approx, u_h_pbr,
                   clips 0.96/0.92
``qqt``            K objective C_Q (the paper's; the default before the ablation)
``qqt+layer``      qqt with one rotation per layer
``layer``          granularity layer
``sst-approx``     V objective: the reference repo's approximation
``vtv``            V objective VᵀV
``u``              composition U (no Hadamard, no bit reversal)
``h-fit``          composition H (data-free Hadamard) with fitted clips
``clip-fixed``     clips 0.96/0.92 instead of fitted
``no-clip``        no clipping (ratios 1.0/1.0)
``g/2``, ``g*2``   half / double the default group size (bits/element 2 + 32/G)
``refine``         ``--refine-steps 64`` (lr 2e-3): Cayley refinement of the rotations on the
                   held-out attention-output error (``numerics.refine``), clips refitted
``refine-S``,      S steps at lr 2e-3 / 64 steps at lr L (e.g. ``refine-32``, ``refine-lr1e-2``);
                   with ``--heldout-seqs 8`` the last 2 held-out sequences choose the step
``refine-lrL``
``codebook``       the default's rotations and clips; 4 calibrated levels per (layer, KV head)
                   and K/V between each group's min and max (``experimental.codebook``, ``range``
                   coding: same fp16 scale/offset, same bits), Lloyd-fitted on the held-out rows
                   the clips are fitted on (rotated and clipped); simulation only
``codebook-std``   the same with each group stored as fp16 mean and std and the levels in
                   standardised units (Lloyd from the fork's fixed Gaussian levels)
``k/2``, ``v/2``    keys (values) in half the default group size, the other cache unchanged
``global/2``,      the full-attention layers' groups halved (quartered), sliding-window layers
``global/4``       unchanged; ``sliding/2`` the reverse
``budget``         per-layer group sizes (K = V) chosen by ``calibration.budget`` on the held-out
                   tables within 2.5 bits, mean and long-context bounds (``--bit-budget 2.5``)
``budget-split``   the same with K and V sizes chosen apart (simulation only)
``budget-mean``,   the same bounded by the mean over layers only (over budget at long contexts
``budget-mean-     on a sliding-window model)
split``
``budget-served``, the budget's tables measured with the serving window (every query reads the
``budget-split-    BF16 sink and its recent window, the rest INT2; ``numerics.clip``
served``           ``HeldoutLayer.serving``); with ``--heldout-tokens 2048`` the held-out rows
                   are longer than Gemma's 512-token sliding window
``lever:*``        a lever on the INT2 error itself (``levers.py``: float8 group parameters,
                   sparse corrections of the largest errors, INT3 in the layers with the
                   largest held-out error within the budget, the logit-noise correction);
                   ``budget-split+corr``: the correction on ``budget-split``
=================  ========================================================================

``--baselines`` picks the baseline methods (``bf16,naive,hadamard``; bf16 is needed for the
relative columns). Per-layer variants are scored against baselines at the default group size.

``codebook-noclip`` is ``codebook`` without clipping (ratios 1.0/1.0): the levels alone handle the tails;
``codebook-inner`` keeps the outer levels at each group's min and max and fits only the inner two.

Per-layer and per-KV-head statistics are the same for ``head`` and ``layer`` granularity when a
model has one KV head (Gemma-3-270M), so ``layer`` only matters for SmolLM2 (3 KV heads).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))   # levers.py beside it

VARIANTS = {
    "default": {},
    "published": {"k_objective": "qqt", "granularity": "layer", "v_objective": "sst-approx",
                  "k_clip": 0.96, "v_clip": 0.92},
    "qqt": {"k_objective": "qqt"},
    "qqt+layer": {"k_objective": "qqt", "granularity": "layer"},
    "layer": {"granularity": "layer"},
    "sst-approx": {"v_objective": "sst-approx"},
    "vtv": {"v_objective": "vtv"},
    "u": {"composition": "u"},
    "h-fit": {"composition": "h"},
    "clip-fixed": {"k_clip": 0.96, "v_clip": 0.92},
    "no-clip": {"k_clip": 1.0, "v_clip": 1.0},
    "g/2": {"group_size": "half"},
    "g*2": {"group_size": "double"},
    "refine": {"refine_steps": 64},
    "refine-16": {"refine_steps": 16},
    "refine-32": {"refine_steps": 32},
    "refine-128": {"refine_steps": 128},
    "refine-lr5e-4": {"refine_steps": 64, "refine_lr": 5e-4},
    "refine-lr1e-2": {"refine_steps": 64, "refine_lr": 1e-2},
    "codebook": {"quantizer": "codebook"},
    "codebook-std": {"quantizer": "codebook-std"},
    "codebook-noclip": {"quantizer": "codebook", "k_clip": 1.0, "v_clip": 1.0},
    "codebook-inner": {"quantizer": "codebook", "fixed_ends": True},
    # a K/V bit budget (per-layer / per-cache group sizes; ``groups`` is resolved by ``variant_groups``)
    "k/2": {"groups": "k/2"},
    "v/2": {"groups": "v/2"},
    "global/2": {"groups": "global/2"},
    "global/4": {"groups": "global/4"},
    "sliding/2": {"groups": "sliding/2"},
    "budget": {"groups": "budget"},
    "budget-split": {"groups": "budget-split"},
    "budget-mean": {"groups": "budget-mean"},
    "budget-mean-split": {"groups": "budget-mean-split"},
    # the budget's tables measured as the serving cache reads the held-out rows (BF16 sink and recent window)
    "budget-served": {"groups": "budget-served"},
    "budget-split-served": {"groups": "budget-split-served"},
    # levers on the INT2 error itself (scripts/experiments/levers.py; simulation), alone or on a budget variant
    "lever:corr": {"lever": {"logit_correction": True}},
    "lever:fp8": {"lever": {"params": "fp8"}},
    "lever:fp8+sparse1": {"lever": {"params": "fp8", "sparse": 1}},
    "lever:fp8+int3": {"lever": {"params": "fp8", "int3": True}},
    "lever:fp8+sparse1+corr": {"lever": {"params": "fp8", "sparse": 1, "logit_correction": True}},
    "lever:sparse4": {"lever": {"sparse": 4}},
    "lever:corr0.5": {"lever": {"logit_correction": 0.5}},
    # the logit-noise correction as the toolkit stores it (--logit-correction; the real cache reads it too)
    "corr": {"logit_correction": 1.0},
    "corr0.5": {"logit_correction": 0.5},
    "budget-split+corr": {"groups": "budget-split", "logit_correction": 1.0},
    "budget-split+corr0.5": {"groups": "budget-split", "logit_correction": 0.5},
}
BUDGET_BITS = 2.5
TEXTS = ("embedded", "embedded-code")


def stats_run(lm, cfg, cache: Path):
    """Collect (or load) the statistics and held-out rows of the default calibration (with the
    ``sst-approx`` accumulator too, so every V objective can be built from one run; the other
    accumulators do not depend on it)."""
    import torch

    from oscar_calib.calibration.collect import StatsRun, collect_statistics
    from oscar_calib.calibration.stats import LayerStats, Reservoir
    from oscar_calib.contract.config import CalibrationConfig
    from oscar_calib.data.corpus import plan_tokens

    plan = plan_tokens(lm.tokenizer, data=cfg.data, split=cfg.split, text_field=cfg.text_field, tokens=cfg.tokens,
                       seq_len=cfg.seq_len, heldout_tokens=cfg.heldout_tokens, heldout_seqs=cfg.heldout_seqs,
                       seed=cfg.seed)
    key = plan.sha256() + lm.fingerprint + ":approx"
    geo = lm.geometry
    if cache.exists():
        state = torch.load(cache, map_location="cpu", weights_only=True)
        if state["key"] == key:
            run = StatsRun(stats=[LayerStats(geo.num_kv_heads, geo.group, geo.head_dim, cfg.pilot_tokens, approx=True)
                                  for _ in range(geo.num_layers)],
                           reservoir=[Reservoir(cfg.heldout_tokens) for _ in range(geo.num_layers)])
            for s, st in zip(run.stats, state["stats"]):
                s.load_state_dict(st)
            for r, rs in zip(run.reservoir, state["reservoir"]):
                r.q, r.k, r.v, r.o = rs["q"], rs["k"], rs["v"], rs["o"]
            run.layer_info = {int(k): v for k, v in state["layer_info"].items()}
            return run, state["timing"]
    run, timing = collect_statistics(lm, plan, CalibrationConfig(**{**cfg.to_dict(), "v_objective": "sst-approx"}))
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"key": key, "timing": timing, "stats": [s.state_dict() for s in run.stats],
                "reservoir": [{"q": r.q, "k": r.k, "v": r.v, "o": r.o} for r in run.reservoir],
                "layer_info": run.layer_info}, cache)
    return run, timing


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--texts", default=",".join(TEXTS), help="held-out texts, one ppl column each")
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0, help="calibration seed (which windows calibrate)")
    ap.add_argument("--heldout-seqs", type=int, default=1, help="held-out sequences the clips (and refinement) "
                    "are fitted on")
    ap.add_argument("--heldout-tokens", type=int, default=512, help="held-out rows per sequence (the clips and the "
                    "budget's tables; calibrate's --heldout-tokens)")
    ap.add_argument("--real-cache", type=int, default=0, metavar="CHUNK",
                    help="also score every variant the real cache can store through OscarCache itself (teacher "
                         "forced in chunks of CHUNK tokens; 1 = one decode step per token), a ppl_real column")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="where the model runs: cpu (default), cuda, or auto")
    ap.add_argument("--dtype", default="float32", help="the model's dtype (float32 by default on every device, as "
                    "on the CPU)")
    ap.add_argument("--baselines", default="bf16,naive,hadamard", help="baseline methods (bf16 is always needed "
                    "for the relative columns)")
    ap.add_argument("--niah", action="append", default=[], metavar="VARIANT=RESULT.json:METHOD",
                    help="attach NIAH at the largest length of METHOD in a scripts/experiments/niah_gpu.py result to the row "
                         "VARIANT (repeatable; a NIAH column in the table)")
    ap.add_argument("--render", action="store_true",
                    help="only re-write --out's table (with --niah attached) from its JSON; loads no model")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if args.render:
        if args.out is None or not args.out.is_file():
            raise SystemExit("error: --render needs --out naming an existing ablation JSON")
        results = json.loads(args.out.read_text())
        attach_niah(results, args.niah)
        if args.niah:
            results["render_command"] = "python scripts/experiments/ablation.py " + " ".join(argv)
        write_results(results, args.out)
        print(table(results))
        return

    import torch

    from oscar_calib.calibration.pipeline import prepare_model
    from oscar_calib.contract.config import CalibrationConfig
    from oscar_calib.contract.defaults import default_group_size
    from oscar_calib.eval import EvalOptions, heldout_sequences

    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or ROOT / "runs" / "ablation" / f"{Path(args.model).name}.json"
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variant(s) {bad}; valid: {', '.join(VARIANTS)}")
    texts = [t.strip() for t in args.texts.split(",") if t.strip()]
    base = CalibrationConfig(model=args.model, device=args.device, dtype=args.dtype, seed=args.seed,
                             heldout_seqs=args.heldout_seqs, heldout_tokens=args.heldout_tokens)
    opts = EvalOptions(methods=tuple(m.strip() for m in args.baselines.split(",") if m.strip()),
                       sequences=args.sequences, seq_len=args.seq_len,
                       sink=base.sink_tokens, recent=base.recent_tokens)     # `oscar eval`'s settings, checked
    t0 = time.perf_counter()
    lm = prepare_model(base)
    geo = lm.geometry
    g0 = default_group_size(geo.head_dim)
    longer = "" if args.heldout_tokens == 512 else f".t{args.heldout_tokens}"
    cache = ROOT / "runs" / "ablation" / f"{Path(args.model).name}.seed{args.seed}.h{args.heldout_seqs}{longer}.stats.pt"
    run, timing = stats_run(lm, base, cache)
    print(f"statistics: {timing.get('statistics_s', 0):.0f} s", flush=True)
    seqs = {t: heldout_sequences(lm.tokenizer, sequences=opts.sequences, seq_len=opts.seq_len, data=t, seed=opts.seed)
            for t in texts}
    results = json.loads(out.read_text()) if out.exists() else {}
    results.setdefault("rows", {})
    results["settings"] = {"model": lm.source.model_id, "tokens": base.tokens, "seq_len": base.seq_len,
                           "calibration_seed": args.seed, "heldout_tokens": base.heldout_tokens,
                           "heldout_seqs": base.heldout_seqs,
                           "eval_sequences": opts.sequences, "eval_seq_len": opts.seq_len, "sink": opts.sink,
                           "recent": opts.recent, "default_group_size": g0, "texts": texts,
                           "threads": torch.get_num_threads(), "device": str(lm.model.device),
                           **({"device_name": torch.cuda.get_device_name(lm.model.device)}
                              if lm.model.device.type == "cuda" else {})}
    results["command"] = "python scripts/experiments/ablation.py " + " ".join(argv)
    attach_niah(results, args.niah)

    def save():
        write_results(results, out)

    def group_of(name: str) -> int:       # per-layer variants (``groups``) count as the default size here
        opt = VARIANTS[name].get("group_size")
        return {None: g0, "half": g0 // 2, "double": min(2 * g0, geo.head_dim)}[opt]

    def score(key: str, scheme, extra: dict) -> None:
        row = results["rows"].setdefault(key, {})
        row.setdefault("ppl", {})
        for t in texts:
            if t in row["ppl"]:
                continue
            t1 = time.perf_counter()
            row["ppl"][t] = perplexity(lm.model, seqs[t], scheme)
            row.setdefault("eval_s", {})[t] = time.perf_counter() - t1
            print(f"{key} on {t}: {row['ppl'][t]:.3f}", flush=True)
        if args.real_cache and key in names and real_storable(scheme):
            for t in texts:
                if t in row.get("ppl_real", {}):
                    continue
                t1 = time.perf_counter()
                row.setdefault("ppl_real", {})[t] = perplexity(lm.model, seqs[t], scheme, real_chunk=args.real_cache)
                row.setdefault("eval_real_s", {})[t] = time.perf_counter() - t1
                print(f"{key} on {t} through OscarCache: {row['ppl_real'][t]:.3f}", flush=True)
            row["real_chunk"] = args.real_cache
        row.update(extra)
        save()

    def missing(key: str) -> bool:
        row = results["rows"].get(key, {})
        real = set(texts) <= set(row.get("ppl_real", {})) if args.real_cache and key in names and \
            key in results["rows"] and not row.get("lever") and not row.get("codebook") else True
        return not set(texts) <= set(row.get("ppl", {})) or not real

    for key, g, m, clips in baselines(names, group_of, g0, opts.methods):
        if missing(key):
            scheme = baseline_scheme(m, geo, g, opts, clips)
            score(key, scheme, {"group_size": None if m == "bf16" else g, "bits_per_element": scheme.bits_per_element})
    for name in names:
        if missing(name):
            scheme, extra = variant_scheme(name, run, base, geo, group_of(name), opts)
            score(name, scheme, extra)
    results["total_s"] = time.perf_counter() - t0
    save()
    print(table(results))


def write_results(results: dict, out: Path) -> None:
    """The JSON and its table (``.md`` beside it)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    out.with_suffix(".md").write_text(table(results) + "\n")


def attach_niah(results: dict, specs: list[str]) -> None:
    """``VARIANT=RESULT.json:METHOD``: store METHOD's NIAH exact-match rate at the result's largest
    length (with its 95% interval, the file and the filler's fingerprint) in row VARIANT."""
    for spec in specs:
        variant, _, rest = spec.partition("=")
        path, _, method = rest.rpartition(":")
        if not variant or not path or not method:
            raise SystemExit(f"error: --niah {spec!r}: expected VARIANT=RESULT.json:METHOD")
        if variant not in results.get("rows", {}):
            raise SystemExit(f"error: --niah: the table has no row {variant!r} (rows: {', '.join(results.get('rows', {}))})")
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: --niah: cannot read {path}: {e}") from None
        summ = next((x for x in data.get("summary", []) if x.get("method") == method), None)
        if summ is None or not summ.get("by_length"):
            found = ", ".join(x.get("method", "?") for x in data.get("summary", []))
            raise SystemExit(f"error: --niah: {path} has no NIAH rates for method {method!r} (methods: {found})")
        longest = max(summ["by_length"], key=int)
        results["rows"][variant]["niah"] = {
            "length": int(longest), "rate": summ["by_length"][longest],
            "interval": summ["by_length_interval"][longest], "prompts": summ["by_length_n"][longest],
            "source": str(path), "method": method,
            "haystack_sha256": data.get("settings", {}).get("haystack_sha256")}


def real_storable(scheme) -> bool:
    """Whether oscar's real cache (OscarCache) can store ``scheme`` (a lever's is simulated only)."""
    from oscar_calib.runtime.cache import not_storable

    return not is_lever(scheme) and not_storable(scheme) is None


def is_lever(scheme) -> bool:
    """A scheme of ``levers.py`` (simulated only, by its own attention)."""
    import levers

    return isinstance(scheme, levers.LeverScheme)


def perplexity(model, seqs, scheme, real_chunk: int = 0) -> float:
    """Perplexity of ``seqs`` read as ``scheme`` stores K/V: the simulation (``oscar eval``'s,
    a lever's own), or with ``real_chunk`` through OscarCache itself
    (:func:`oscar_calib.eval.real_cache_nll`, ``real_chunk`` tokens per call; 1: decode steps)."""
    from oscar_calib.eval import real_cache_nll, sequence_nll

    if is_lever(scheme):                           # its own simulation
        import levers

        sequence_nll = levers.sequence_nll  # noqa: F811
    if real_chunk:
        sequence_nll = lambda m, ids, sch: real_cache_nll(m, ids, sch, chunk=real_chunk)  # noqa: E731, F811
    nll = n = 0
    for s in seqs:
        a, b = sequence_nll(model, s.unsqueeze(0), scheme)
        nll, n = nll + a, n + b
    return math.exp(nll / n)


def baselines(names, group_of, g0, methods):
    """(row key, group size, method, Hadamard clips) of every baseline the variants need: each method
    at every group size used (BF16 once), and Hadamard without clips when ``no-clip`` runs."""
    groups = sorted({group_of(v) for v in names})
    out = []
    for g in groups:
        for m in (x for x in methods if x != "bf16" or g == groups[0]):
            out.append((m if m == "bf16" else f"{m}@{g}", g, m, None))
    if "no-clip" in names:
        out.append((f"hadamard-noclip@{g0}", g0, "hadamard", (1.0, 1.0)))
    return out


def baseline_scheme(method, geo, g, opts, clips):
    from oscar_calib.eval.methods import build_schemes

    kw = {"hadamard_clips": clips} if clips else {}
    return build_schemes([method], geo, group_size=g, sink=opts.sink, recent=opts.recent, **kw)[method]


def variant_scheme(name, run, base, geo, g, opts):
    """The KV scheme of one variant (its rotations and clips re-built from the shared statistics)
    and the row's extra fields."""
    import dataclasses

    from oscar_calib.calibration.fit import build_rotations
    from oscar_calib.contract.artifact import Artifact
    from oscar_calib.contract.config import CalibrationConfig
    from oscar_calib.runtime.scheme import KVScheme

    options = {k: v for k, v in VARIANTS[name].items()
               if k not in ("group_size", "quantizer", "fixed_ends", "groups", "lever")}
    cfg = CalibrationConfig(**{**base.to_dict(), **options, "group_size": g}).validate()
    t1 = time.perf_counter()
    layers, rows = build_rotations(run, cfg, geo, g)
    groups, budget = variant_groups(VARIANTS[name].get("groups"), run, layers, cfg, geo, g)
    if groups:
        layers, rows = build_rotations(run, cfg, geo, g, groups=groups)
    t_rot = time.perf_counter() - t1
    art = Artifact(layers=layers, metadata={"group_size": str(g), "num_kv_heads": str(geo.num_kv_heads),
                                            "head_dim": str(geo.head_dim)})
    scheme = KVScheme.from_artifact(art, group_size=g, sink=opts.sink, recent=opts.recent,
                                    logit_correction=cfg.logit_correction)
    if groups:
        scheme = dataclasses.replace(scheme,
                                     k_groups=[x[0] for x in groups], v_groups=[x[1] for x in groups])
    extra = {"group_size": g, "bits_per_element": scheme.bits_per_element, "options": VARIANTS[name],
             **({"groups": groups, "long_bits_per_element": long_bits(scheme, run)} if groups else {}),
             **({"budget": budget} if budget else {}),
             "rotations_s": t_rot,
             "heldout_attn_error": sum(r["heldout"]["oscar"]["attn"] for r in rows) / len(rows),
             "k_clip_mean": sum(float(lr.k_clip.mean()) for lr in layers) / len(layers),
             "v_clip_mean": sum(float(lr.v_clip.mean()) for lr in layers) / len(layers)}
    quantizer = VARIANTS[name].get("quantizer")
    if quantizer:
        scheme, extra["codebook"] = with_codebooks(scheme, run, layers, g, quantizer,
                                                   VARIANTS[name].get("fixed_ends", False))
    lever = VARIANTS[name].get("lever")
    if lever:
        scheme, extra["lever"] = with_lever(scheme, lever, rows, run, geo)
        extra["bits_per_element"] = scheme.bits_per_element
        if groups:
            extra["long_bits_per_element"] = long_bits(scheme, run)
    if any("refine" in r for r in rows):
        reps = [h for r in rows for h in r["refine"]]
        extra["refine_objective"] = {"before": sum(h["before"] for h in reps) / len(reps),
                                     "after": sum(h["after"] for h in reps) / len(reps),
                                     "heads_moved": sum(h["best_step"] > 0 for h in reps), "heads": len(reps)}
    return scheme, extra


def with_lever(scheme, lever: dict, rows, run, geo):
    """``scheme`` with a lever of ``levers.py`` and its record; ``int3``: INT3 for the layers with the
    largest held-out attention error (the default rows' ``heldout``) while the mean bits (and the
    full-attention layers' mean) stay within :data:`BUDGET_BITS`."""
    import levers

    opts = {k: v for k, v in lever.items() if k != "int3"}
    sch = levers.lever_scheme(scheme, geo.head_dim, **opts)
    if lever.get("int3"):
        order = sorted(range(len(rows)), key=lambda i: -rows[i]["heldout"]["oscar"]["attn"])
        chosen: list[int] = []
        for i in order:
            trial = levers.lever_scheme(scheme, geo.head_dim, **opts, int3_layers=tuple(chosen + [i]))
            if trial.bits_per_element <= BUDGET_BITS + 1e-9 and long_bits(trial, run) <= BUDGET_BITS + 1e-9:
                chosen.append(i)
        sch = levers.lever_scheme(scheme, geo.head_dim, **opts, int3_layers=tuple(sorted(chosen)))
    return sch, {**opts, "int3_layers": list(sch.int3_layers)}


def full_layers(run) -> list[int]:
    """Layers without a sliding window (their history grows with the context)."""
    return [i for i in sorted(run.layer_info) if not run.layer_info[i]["sliding_window"]]


def long_bits(scheme, run) -> float:
    """Bits per element at long contexts: the full-attention layers' mean (``calibration.budget``)."""
    longs = full_layers(run) or list(range(scheme.num_layers))
    return sum(scheme.layer_bits(i) for i in longs) / len(longs)


def variant_groups(spec, run, layers, cfg, geo, g0):
    """Per layer ``(G_K, G_V)`` of a bit-budget variant (None for the others) and, for the greedy
    ones, what the allocation saw."""
    from oscar_calib.calibration.budget import allocate, budget_tables, candidate_sizes
    from oscar_calib.calibration.fit import heldout_layer

    if spec is None:
        return None, None
    n, full = geo.num_layers, set(full_layers(run))
    fixed = {"k/2": lambda i: (g0 // 2, g0), "v/2": lambda i: (g0, g0 // 2),
             "global/2": lambda i: (g0 // 2,) * 2 if i in full else (g0, g0),
             "global/4": lambda i: (g0 // 4,) * 2 if i in full else (g0, g0),
             "sliding/2": lambda i: (g0, g0) if i in full else (g0 // 2,) * 2}
    if spec in fixed:
        return [fixed[spec](i) for i in range(n)], None
    import dataclasses

    sizes = candidate_sizes(geo.head_dim)
    serving = (cfg.sink_tokens, cfg.recent_tokens) if "served" in spec else None
    tables = budget_tables(lambda i: dataclasses.replace(heldout_layer(run, i), serving=serving),
                           [(lr.k_rotation, lr.v_rotation) for lr in layers],
                           [s.covariance("q") for s in run.stats], cfg, geo.num_kv_heads, sizes)
    alloc = allocate(tables, sizes, BUDGET_BITS, tied="split" not in spec,
                     long_layers=None if "mean" in spec else sorted(full))
    return alloc.groups, {"sizes": list(sizes), "mean_bits": alloc.mean_bits, "long_bits": alloc.long_bits,
                          "heldout_mse": alloc.heldout_mse,
                          "tables": [t.tolist() for t in tables]}


def with_codebooks(scheme, run, layers, g, quantizer, fixed_ends=False):
    """``scheme`` storing its history with codebooks fitted per layer, KV head and K/V on the held-out
    rows, and a summary: mean levels and the squared error on those rows (rotated and clipped) with
    the fitted levels relative to uniform INT2 (``k``, ``v``) and to the initial levels, averaged over
    layers and KV heads."""
    import torch

    from oscar_calib.calibration.fit import heldout_layer
    from oscar_calib.experimental.codebook import (
        CodebookScheme,
        fake_quant_codebook,
        fit_layer_levels,
        initial_levels,
    )
    from oscar_calib.numerics.quant import clip_rows, fake_quant_int2

    coding = "std" if quantizer == "codebook-std" else "range"
    kl, vl, ratios = [], [], {"k": [], "v": [], "k_vs_initial": [], "v_vs_initial": []}
    for i, lr in enumerate(layers):
        held = heldout_layer(run, i)
        k_rows, v_rows = torch.cat(held.k), torch.cat(held.v)
        k_lv, v_lv = fit_layer_levels(k_rows, v_rows, lr.k_rotation, lr.k_clip, lr.v_rotation, lr.v_clip, g, coding,
                                      fixed_ends)
        kl.append(k_lv)
        vl.append(v_lv)
        for which, x, rot, clip, lv in (("k", k_rows, lr.k_rotation, lr.k_clip, k_lv),
                                        ("v", v_rows, lr.v_rotation, lr.v_clip, v_lv)):
            for h in range(x.shape[1]):
                y = clip_rows(x[:, h].float() @ rot[h].float(), float(clip[h]))
                fitted = float((fake_quant_codebook(y, lv[h], g, coding) - y).pow(2).mean())
                int2 = float((fake_quant_int2(y, g) - y).pow(2).mean())
                init = float((fake_quant_codebook(y, initial_levels(coding), g, coding) - y).pow(2).mean())
                ratios[which].append(fitted / max(int2, 1e-300))
                ratios[which + "_vs_initial"].append(fitted / max(init, 1e-300))
    summary = {"coding": coding, "fixed_ends": fixed_ends,
               "k_levels_mean": torch.stack(kl).mean((0, 1)).tolist(),
               "v_levels_mean": torch.stack(vl).mean((0, 1)).tolist(),
               "heldout_mse_ratio": {w: sum(r) / len(r) for w, r in ratios.items()}}
    return CodebookScheme.of(scheme, quantizer, kl, vl, name=quantizer), summary


def table(results: dict) -> str:
    rows, st = results["rows"], results["settings"]
    texts = st["texts"]
    bf = rows.get("bf16", {}).get("ppl", {})
    niah = any("niah" in r for r in rows.values())
    label = {src: chr(ord("a") + i) for i, src in enumerate(sorted({r["niah"]["source"] for r in rows.values()
                                                                   if "niah" in r}))}
    lines = [f"{st['model']}: held-out perplexity, {st['eval_sequences']}×{st['eval_seq_len']} tokens per text, "
             f"BF16 sink {st['sink']} + recent {st['recent']}; calibration seed {st['calibration_seed']}, "
             f"{st.get('heldout_seqs', 1)} held-out sequence(s) of {st['heldout_tokens']} rows",
             f"command: `{results.get('command', '')}`", "",
             "bits/elem: mean over layers (every layer holding as many tokens); (long ...): the full-attention "
             "layers' mean, what the average tends to at long contexts when sliding-window layers hold only their "
             "window", "",
             "| variant | group | bits/elem | " + " | ".join(f"ppl {t} (vs BF16, gap closed)" for t in texts) + " |"
             + (" NIAH, largest length [95%] |" if niah else ""),
             "|---|---|---|" + "---|" * (len(texts) + bool(niah))]
    for name, r in rows.items():
        g = r.get("group_size")
        had = rows.get(f"hadamard@{g}", {}).get("ppl", {}) if g else {}
        cells = []
        for t in texts:
            p = r.get("ppl", {}).get(t)
            if p is None:
                cells.append("–")
                continue
            rel = f"{(p / bf[t] - 1):+.2%}" if bf.get(t) else "–"
            gap = f"{(had[t] - p) / (had[t] - bf[t]):+.0%}" if had.get(t) and bf.get(t) and had[t] != bf[t] else "–"
            real = r.get("ppl_real", {}).get(t)
            cells.append(f"{p:.3f} ({rel}, {gap})" + (f"; real cache {real:.3f}" if real is not None else ""))
        bits = f"{r['bits_per_element']:.3f}"
        if r.get("long_bits_per_element") is not None and abs(r["long_bits_per_element"] - r["bits_per_element"]) > 1e-9:
            bits += f" (long {r['long_bits_per_element']:.3f})"
        group = g or "–"
        if r.get("groups"):
            flat = [x for pair in r["groups"] for x in pair]
            group = f"{min(flat)}–{max(flat)} per layer" + ("" if all(a == b for a, b in r["groups"]) else ", K≠V")
        if niah:
            n = r.get("niah")
            cells.append(f"{n['rate']:.2f} [{n['interval'][0]:.2f}, {n['interval'][1]:.2f}] at {n['length']} "
                         f"({label[n['source']]})" if n else "–")
        lines.append(f"| {name} | {group} | {bits} | " + " | ".join(cells) + " |")
    sources = sorted({(r["niah"]["source"], r["niah"].get("haystack_sha256") or "not recorded")
                      for r in rows.values() if "niah" in r})
    if sources:
        lines += ["", "NIAH: exact match through the real cache (scripts/experiments/niah_gpu.py), from "
                  + "; ".join(f"({label[src]}) `{src}` (filler sha256 {h})" for src, h in sources)
                  + ". Compare rates within one file, or across files whose filler fingerprints agree."]
    if results.get("render_command"):
        lines.append(f"NIAH attached with: `{results['render_command']}`")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
