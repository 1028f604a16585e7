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
                          (``calibrate.shared.CENTER_KEY_OBJECTIVE`` off): the clips still fitted centered
``plain+mean``            ``plain``'s rotations and clips with ``center``'s key means added: centering
                          alone, nothing fitted for it (needs both artifacts)
``plain lc0``             ``plain`` scored without the logit-noise correction (``--logit-correction 0``)
``plain+mean lc0``        ``plain+mean`` likewise
``plain noclip``          ``plain`` with every key clip ratio 1 (no key clip)
``plain+mean noclip``     ``plain+mean`` likewise
========================  ====================================================================

A run with ``--variants`` keeps the rows of the other variants already in ``--out`` (and its BF16
figures), so variants can be added one run at a time; a derived variant needs the artifacts it is
derived from in ``runs/centering/MODEL/``. The scored-only variants (``lc0``) and the derived
no-clip ones are not verified (their verify columns read "–").

Each variant is scored on ``--sequences`` × ``--seq-len`` held-out tokens of every text of
``--texts`` (BF16 sink and recent window, INT2 history: the perplexity simulation, which is the
real cache's arithmetic) and, with ``--long N``, on one N-token sequence of the first text; verify
runs at its default depths on the corpus' other held-out half. ``rows`` (with ``plain`` and
``center`` present) records, over the first held-out sequence of the first text and every layer and
KV head: the share of the keys' energy in the calibration's mean key, how evenly ``plain``'s key
rotation spreads that mean over the channels (the largest ``|μR|`` over ``|μ|/√d``; 1 = evenly), and
the median range (max − min) of a stored row rotated by ``plain``'s rotation, raw and centered:
what centering takes out of each INT2 group's range. Artifacts go to ``runs/centering/MODEL/VARIANT``.
Runs on the CPU (nice it on a shared machine); the time of every stage is recorded.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# calibrated: (center_keys, centered ktk objective); derived: ("derive", base, mean from, key clip off);
# scored only: ("score", artifact variant, eval logit-correction gain)
VARIANTS = {
    "plain": (False, True), "center": (True, True), "center-raw-ktk": (True, False),
    "plain+mean": ("derive", "plain", "center", False),
    "plain lc0": ("score", "plain", 0.0), "plain+mean lc0": ("score", "plain+mean", 0.0),
    "plain noclip": ("derive", "plain", None, True), "plain+mean noclip": ("derive", "plain", "center", True),
}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config", type=Path, help="a recipe YAML (its calibration: section)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--texts", default="embedded", help="comma-separated eval texts (embedded, embedded-code, a file)")
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--long", type=int, default=8192, help="one sequence of this many tokens (0: none)")
    ap.add_argument("--out", type=Path, required=True, help="the result JSON (a .md table is written beside it)")
    ap.add_argument("--reuse", action="store_true", help="a variant already in --out with its artifact in runs/: "
                    "only the texts (and --long) it was not scored on yet")
    args = ap.parse_args(argv)
    import torch

    from oscar_calib.calibrate import pipeline, shared
    from oscar_calib.contract.artifact import load_artifact
    from oscar_calib.contract.config import config_from_options
    from oscar_calib.model.load import load_model
    from oscar_calib.tools.verify import verify_artifact

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
    rows, bf16 = [r for r in old["rows"] if r["variant"] not in variants], dict(old["bf16"])
    runs = ROOT / "runs" / "centering" / name
    done = {r["variant"]: r for r in old["rows"]}
    for v in variants:
        spec = VARIANTS[v]
        scored_only = spec[0] == "score"
        out = runs / (spec[1] if scored_only else v)
        gain = spec[2] if scored_only else None
        if args.reuse and v in done and (out / "oscar.safetensors").exists():
            row, art = done[v], load_artifact(out)
            score(row, art, lm, texts, args, bf16, gain)
            rows.append(row)
            continue
        t1 = time.perf_counter()
        if scored_only:
            center = centered_objective = None
            if not (out / "oscar.safetensors").exists():
                raise SystemExit(f"error: {v} scores {out}, which is not there: run the variant {spec[1]!r} first")
        elif spec[0] == "derive":
            center, centered_objective = spec[2] is not None, False
            derive(runs / spec[1], None if spec[2] is None else runs / spec[2], out, no_key_clip=spec[3])
        else:
            center, centered_objective = spec
            cfg = base.__class__(**{**base.to_dict(), "center_keys": center})
            shared.CENTER_KEY_OBJECTIVE = centered_objective
            pipeline.calibrate(cfg, out, overwrite=True, loaded=lm)
            shared.CENTER_KEY_OBJECTIVE = True
        t2 = time.perf_counter()
        art = load_artifact(out)
        row = {"variant": v, "center_keys": art.settings.key_centering,
               "centered_objective": bool(centered_objective and center), "eval_logit_correction": gain,
               "verify_attn": None, "verify_attn_hadamard": None, "verify_logit": None, "ppl": {},
               "times_s": {"build": t2 - t1}}
        if not scored_only and not (spec[0] == "derive" and spec[3]):
            verdict = verify_artifact(out, loaded=lm, write=False, plot=False).summary()
            row.update(verify_attn=verdict["mean_attn_error"], verify_attn_hadamard=verdict["mean_attn_error_hadamard"],
                       verify_logit=verdict["mean_logit_error"])
            row["times_s"]["verify"] = time.perf_counter() - t2
        score(row, art, lm, texts, args, bf16, gain)
        rows.append(row)
        print(json.dumps(row), flush=True)
    rows.sort(key=lambda r: list(VARIANTS).index(r["variant"]))
    result = {"model_id": lm.source.model_id, "config": str(args.config), "bf16": bf16, "rows": rows,
              "settings": {"sequences": args.sequences, "seq_len": args.seq_len, "texts": texts, "long": args.long,
                           "threads": torch.get_num_threads()},
              "timings": timings}
    if (runs / "plain" / "oscar.safetensors").exists() and (runs / "center" / "oscar.safetensors").exists():
        t3 = time.perf_counter()
        result["rows_stored"] = stored_rows(lm, load_artifact(runs / "plain"), load_artifact(runs / "center"), texts[0])
        timings["rows_stored_s"] = time.perf_counter() - t3
    timings["total_s"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(render(result))
    print(render(result))


def score(row: dict, art, lm, texts: list[str], args, bf16: dict, gain: float | None = None) -> None:
    """Perplexity of ``art`` on every text (and at ``--long``) ``row`` has no figure for yet; BF16 once
    per text; ``gain``: the logit-noise correction's gain instead of the artifact's."""
    from oscar_calib.eval import EvalOptions, evaluate_ppl

    jobs = [(t, t, args.sequences, args.seq_len) for t in texts]
    if args.long:
        jobs.append((f"{texts[0]}@{args.long}", texts[0], 1, args.long))
    for key, text, n, length in jobs:
        if key in row["ppl"]:
            continue
        t0 = time.perf_counter()
        methods = "oscar" if key in bf16 else "bf16,oscar"
        res = evaluate_ppl(lm, EvalOptions(methods=methods, sequences=n, seq_len=length, data=text,
                                           logit_correction=gain), artifact=art)
        got = {r["method"]: r["ppl"] for r in res.rows}
        bf16.setdefault(key, got.get("bf16"))
        row["ppl"][key] = got["oscar"]
        row["times_s"][f"eval {key}"] = time.perf_counter() - t0
        print(json.dumps({"variant": row["variant"], key: got}), flush=True)


def derive(plain: Path, centered: Path | None, out: Path, *, no_key_clip: bool = False) -> None:
    """``plain``'s artifact with ``centered``'s key means (and ``k_centered``) when given, every key
    clip ratio 1 with ``no_key_clip``; written to ``out``."""
    import dataclasses

    import torch

    from oscar_calib.contract.artifact import load_artifact, write_artifact_files

    a = load_artifact(plain)
    what = []
    if centered is not None:
        for la, lc in zip(a.layers, load_artifact(centered).layers):
            la.k_mean = lc.k_mean
        st = a.settings.replace(key_centering=True)
        a = dataclasses.replace(a, settings=st, metadata={**a.metadata, **st.metadata()})
        what.append("the centered run's key means")
    if no_key_clip:
        for la in a.layers:
            la.k_clip = torch.ones_like(la.k_clip)
        what.append("no key clip")
    out.mkdir(parents=True, exist_ok=True)
    write_artifact_files(out, a, f"plain rotations and clips with {' and '.join(what)}\n", a.report)


def stored_rows(lm, plain, centered, text: str) -> dict:
    """What centering does to the rows INT2 stores (see the module docstring), over the first held-out
    sequence of ``text``: means over every layer and KV head."""
    import torch

    from oscar_calib.eval.ppl import heldout_sequences
    from oscar_calib.model.capture import Capture, capture_forward

    ids = heldout_sequences(lm.tokenizer, sequences=1, seq_len=2048, data=text, seed=0)[0]
    keys = {}

    def keep(layer, module, q, k, v, o, kw):
        keys[layer] = k[0].float()                               # [H, T, d]

    with torch.no_grad(), Capture(lm.model, [keep]):
        capture_forward(lm.model, ids.unsqueeze(0).to(lm.model.device))
    share, spread, raw, cen = [], [], [], []
    for i, k in sorted(keys.items()):
        r, mu = plain.layers[i].k_rotation.float(), centered.layers[i].k_mean.float()
        y = torch.einsum("htd,hde->hte", k, r)
        m = torch.einsum("hd,hde->he", mu, r)
        share += (mu.pow(2).sum(-1) / k.pow(2).sum(-1).mean(-1)).tolist()
        spread += (m.abs().amax(-1) / (mu.norm(dim=-1) / k.shape[-1] ** 0.5)).tolist()
        raw += (y.amax(-1) - y.amin(-1)).median(-1).values.tolist()
        yc = y - m[:, None]
        cen += (yc.amax(-1) - yc.amin(-1)).median(-1).values.tolist()
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"tokens": int(ids.numel()), "mean_energy_share": mean(share), "mean_spread": mean(spread),
            "median_row_range_raw": mean(raw), "median_row_range_centered": mean(cen)}


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
                 f"{s['median_row_range_raw']:.3f}, centered {s['median_row_range_centered']:.3f}.\n")
    return text


if __name__ == "__main__":
    main()
