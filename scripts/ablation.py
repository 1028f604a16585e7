#!/usr/bin/env python
"""Ablation of the calibration options, measured as held-out perplexity with a 2-bit KV cache.

    python scripts/ablation.py smollm2-135m            # -> runs/ablation/smollm2-135m.json + a table
    python scripts/ablation.py gemma3-270m
    python scripts/ablation.py smollm2-135m --variants default,layer,clip-fixed --sequences 1

One set of statistics is collected (``oscar calibrate``'s defaults: 8192 tokens of the embedded
corpus' calibration half, sequences of 1024, seed 0) and cached in ``runs/ablation/MODEL.stats.pt``;
every variant re-runs only the rotation and clip step (``pipeline.build_rotations``) with its
options changed, and is scored by ``oscar eval``'s perplexity (``eval.ppl.sequence_nll``: 2 × 2048
held-out tokens, BF16 sink 64 + recent 256 per query position, INT2 history). Baselines use the
same sink, window and group size: BF16, naive INT2 (no rotation, no clip) and Hadamard (QuaRot-INT2,
clips 0.96/0.92).

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
=================  ========================================================================

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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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
}


def stats_run(lm, cfg, cache: Path):
    """Collect (or load) the statistics and held-out rows of the default calibration (with the
    ``sst-approx`` accumulator too, so every V objective can be built from one run; the other
    accumulators do not depend on it)."""
    import torch

    from oscar_calib.calibrate.corpus import plan_tokens
    from oscar_calib.calibrate.pipeline import StatsRun, collect_statistics
    from oscar_calib.calibrate.stats import LayerStats, Reservoir
    from oscar_calib.spec.config import CalibrationConfig

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()

    import torch

    from oscar_calib.calibrate.pipeline import build_rotations, prepare_model
    from oscar_calib.eval import EvalOptions
    from oscar_calib.eval.methods import build_schemes
    from oscar_calib.eval.ppl import heldout_sequences, sequence_nll
    from oscar_calib.runtime.scheme import KVScheme
    from oscar_calib.spec.artifact import Artifact
    from oscar_calib.spec.config import CalibrationConfig
    from oscar_calib.spec.defaults import default_group_size

    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or ROOT / "runs" / "ablation" / f"{Path(args.model).name}.json"
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variant(s) {bad}; valid: {', '.join(VARIANTS)}")
    base = CalibrationConfig(model=args.model, device="cpu")
    opts = EvalOptions(methods=("bf16", "naive", "hadamard"), sequences=args.sequences, seq_len=args.seq_len,
                       sink=base.sink_tokens, recent=base.recent_tokens)     # `oscar eval`'s settings, checked
    t0 = time.perf_counter()
    lm = prepare_model(base)
    geo = lm.geometry
    g0 = default_group_size(geo.head_dim)
    run, timing = stats_run(lm, base, out.with_suffix(".stats.pt"))
    print(f"statistics: {timing.get('statistics_s', 0):.0f} s", flush=True)
    seqs = heldout_sequences(lm.tokenizer, sequences=opts.sequences, seq_len=opts.seq_len, seed=opts.seed)
    results = json.loads(out.read_text()) if out.exists() else {}
    results.setdefault("rows", {})
    results["settings"] = {"model": lm.source.model_id, "tokens": base.tokens, "seq_len": base.seq_len,
                           "eval_sequences": opts.sequences, "eval_seq_len": opts.seq_len, "sink": opts.sink,
                           "recent": opts.recent, "default_group_size": g0}

    def ppl(scheme) -> float:
        nll = n = 0
        for s in seqs:
            a, b = sequence_nll(lm.model, s.unsqueeze(0), scheme)
            nll, n = nll + a, n + b
        return math.exp(nll / n)

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")

    def group_of(name: str) -> int:
        opt = VARIANTS[name].get("group_size")
        return {None: g0, "half": g0 // 2, "double": min(2 * g0, geo.head_dim)}[opt]

    groups = sorted({group_of(v) for v in names})
    for g in groups:                                 # baselines at every group size used
        for m in (x for x in opts.methods if x != "bf16" or g == groups[0]):
            key = m if m == "bf16" else f"{m}@{g}"
            if key in results["rows"]:
                continue
            t1 = time.perf_counter()
            scheme = build_schemes([m], geo, group_size=g, sink=opts.sink, recent=opts.recent)[m]
            results["rows"][key] = {"ppl": ppl(scheme), "group_size": None if m == "bf16" else g,
                                    "bits_per_element": scheme.bits_per_element, "eval_s": time.perf_counter() - t1}
            print(f"{key}: {results['rows'][key]['ppl']:.3f}", flush=True)
            save()
    key = f"hadamard-noclip@{g0}"                     # the no-clip reference point for ``no-clip``
    if "no-clip" in names and key not in results["rows"]:
        scheme = build_schemes(["hadamard"], geo, group_size=g0, sink=opts.sink, recent=opts.recent,
                               hadamard_clips=(1.0, 1.0))["hadamard"]
        results["rows"][key] = {"ppl": ppl(scheme), "group_size": g0, "bits_per_element": scheme.bits_per_element}
        print(f"{key}: {results['rows'][key]['ppl']:.3f}", flush=True)
        save()
    for name in names:
        if name in results["rows"]:
            continue
        opts = {k: v for k, v in VARIANTS[name].items() if k != "group_size"}
        g = group_of(name)
        cfg = CalibrationConfig(**{**base.to_dict(), **opts, "group_size": g})
        t1 = time.perf_counter()
        layers, _ = build_rotations(run, cfg, geo, g)
        t_rot = time.perf_counter() - t1
        art = Artifact(layers=layers, metadata={"group_size": str(g), "num_kv_heads": str(geo.num_kv_heads),
                                                "head_dim": str(geo.head_dim)})
        scheme = KVScheme.from_artifact(art, group_size=g, sink=opts.sink, recent=opts.recent)
        results["rows"][name] = {"ppl": ppl(scheme), "group_size": g, "bits_per_element": scheme.bits_per_element,
                                 "options": VARIANTS[name], "rotations_s": t_rot,
                                 "eval_s": time.perf_counter() - t1 - t_rot,
                                 "k_clip_mean": sum(float(lr.k_clip.mean()) for lr in layers) / len(layers),
                                 "v_clip_mean": sum(float(lr.v_clip.mean()) for lr in layers) / len(layers)}
        print(f"{name}: {results['rows'][name]['ppl']:.3f}", flush=True)
        save()
    results["total_s"] = time.perf_counter() - t0
    save()
    print_table(results)


def print_table(results: dict) -> None:
    rows = results["rows"]
    bf = rows.get("bf16", {}).get("ppl")
    print(f"\n{results['settings']['model']}: held-out perplexity, {results['settings']['eval_sequences']}×"
          f"{results['settings']['eval_seq_len']} tokens, BF16 sink {results['settings']['sink']} + recent "
          f"{results['settings']['recent']}")
    print("| variant | group | bits/elem | ppl | vs Hadamard (same G) | Hadamard→BF16 gap closed |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        g = r.get("group_size")
        had = rows.get(f"hadamard@{g}", {}).get("ppl") if g else None
        vs = f"{r['ppl'] - had:+.3f}" if had else "–"
        gap = f"{(had - r['ppl']) / (had - bf):+.0%}" if had and bf and had != bf else "–"
        print(f"| {name} | {g or '–'} | {r['bits_per_element']:.3f} | {r['ppl']:.3f} | {vs} | {gap} |")


if __name__ == "__main__":
    main()
