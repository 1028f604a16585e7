#!/usr/bin/env python
"""Key centering measured: a recipe calibrated without and with ``--center-keys`` (and, with it, the
``ktk`` key objective of the raw keys instead of the centered ones), then ``oscar eval``'s held-out
perplexity (``--methods bf16,oscar``) and ``oscar verify``'s attention error of each artifact.

    python scripts/experiments/centering.py configs/smollm2-135m.yaml \
        --out scripts/experiments/results/centering_smollm2-135m.json         # also writes the .md beside it
    python scripts/experiments/centering.py configs/gemma3-270m.yaml --long 0 \
        --out scripts/experiments/results/centering_gemma3-270m.json

=================  ===========================================================================
variant            calibration (everything else the recipe's)
=================  ===========================================================================
``plain``          the recipe as it is (keys stored raw)
``center``         ``center_keys: true``: keys stored centered on the calibration's mean key,
                   the ``ktk`` objective and the clips fitted on the centered keys
``center-raw-ktk`` ``center_keys: true`` with the ``ktk`` objective of the raw keys
                   (``calibrate.shared.CENTER_KEY_OBJECTIVE`` off): the clips still fitted centered
``plain+mean``     ``plain``'s rotations and clips with ``center``'s key means added: centering
                   alone, nothing fitted for it (needs both artifacts)
=================  ===========================================================================

A run with ``--variants`` keeps the rows of the other variants already in ``--out`` (and its BF16
figures), so variants can be added one run at a time.

Each variant is scored on ``--sequences`` × ``--seq-len`` held-out tokens of every text of
``--texts`` (BF16 sink and recent window, INT2 history: the perplexity simulation, which is the
real cache's arithmetic) and, with ``--long N``, on one N-token sequence of the first text; verify
runs at its default depths on the corpus' other held-out half. Artifacts go to
``runs/centering/MODEL/VARIANT``. Runs on the CPU; the time of every stage is recorded.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VARIANTS = {"plain": (False, True), "center": (True, True), "center-raw-ktk": (True, False), "plain+mean": None}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config", type=Path, help="a recipe YAML (its calibration: section)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--texts", default="embedded", help="comma-separated eval texts (embedded, embedded-code, a file)")
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--long", type=int, default=8192, help="one sequence of this many tokens (0: none)")
    ap.add_argument("--out", type=Path, required=True, help="the result JSON (a .md table is written beside it)")
    args = ap.parse_args(argv)
    import torch

    from oscar_calib.calibrate import pipeline, shared
    from oscar_calib.contract.artifact import load_artifact
    from oscar_calib.contract.config import config_from_options
    from oscar_calib.eval import EvalOptions, evaluate_ppl
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
    for v in variants:
        out = runs / v
        t1 = time.perf_counter()
        if VARIANTS[v] is None:
            center = centered_objective = None
            with_means(runs / "plain", runs / "center", out)
        else:
            center, centered_objective = VARIANTS[v]
            cfg = base.__class__(**{**base.to_dict(), "center_keys": center})
            shared.CENTER_KEY_OBJECTIVE = centered_objective
            pipeline.calibrate(cfg, out, overwrite=True, loaded=lm)
            shared.CENTER_KEY_OBJECTIVE = True
        t2 = time.perf_counter()
        verdict = verify_artifact(out, loaded=lm, write=False, plot=False).summary()
        t3 = time.perf_counter()
        art = load_artifact(out)
        row = {"variant": v, "center_keys": center is not False, "centered_objective": bool(centered_objective and center),
               "verify_attn": verdict["mean_attn_error"], "verify_attn_hadamard": verdict["mean_attn_error_hadamard"],
               "verify_logit": verdict["mean_logit_error"], "ppl": {},
               "times_s": {"calibrate": t2 - t1, "verify": t3 - t2}}
        for text in texts:
            methods = "oscar" if text in bf16 else "bf16,oscar"
            t4 = time.perf_counter()
            res = evaluate_ppl(lm, EvalOptions(methods=methods, sequences=args.sequences, seq_len=args.seq_len,
                                               data=text), artifact=art)
            got = {r["method"]: r["ppl"] for r in res.rows}
            bf16.setdefault(text, got.get("bf16"))
            row["ppl"][text] = got["oscar"]
            row["times_s"][f"eval {text}"] = time.perf_counter() - t4
        if args.long:
            t5 = time.perf_counter()
            key = f"{texts[0]}@{args.long}"
            methods = "oscar" if key in bf16 else "bf16,oscar"
            res = evaluate_ppl(lm, EvalOptions(methods=methods, sequences=1, seq_len=args.long, data=texts[0]),
                               artifact=art)
            got = {r["method"]: r["ppl"] for r in res.rows}
            bf16.setdefault(key, got.get("bf16"))
            row["ppl"][key] = got["oscar"]
            row["times_s"][f"eval {key}"] = time.perf_counter() - t5
        rows.append(row)
        print(json.dumps(row), flush=True)
    timings["total_s"] = time.perf_counter() - t0
    result = {"model_id": lm.source.model_id, "config": str(args.config), "bf16": bf16, "rows": rows,
              "settings": {"sequences": args.sequences, "seq_len": args.seq_len, "texts": texts, "long": args.long,
                           "threads": torch.get_num_threads()},
              "timings": timings}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(render(result))
    print(render(result))


def with_means(plain: Path, centered: Path, out: Path) -> None:
    """``plain``'s artifact with ``centered``'s key means (and ``k_centered``), written to ``out``."""
    import dataclasses

    from oscar_calib.contract.artifact import load_artifact, write_artifact_files

    a, c = load_artifact(plain), load_artifact(centered)
    for la, lc in zip(a.layers, c.layers):
        la.k_mean = lc.k_mean
    art = dataclasses.replace(a, settings=a.settings.replace(key_centering=True),
                              metadata={**a.metadata, **a.settings.replace(key_centering=True).metadata()})
    out.mkdir(parents=True, exist_ok=True)
    write_artifact_files(out, art, "plain rotations and clips with the centered run's key means\n", a.report)


def render(result: dict) -> str:
    """The result as a Markdown table: perplexity per text (and its gap to BF16), verify's errors."""
    keys = list(result["bf16"])
    head = ["variant", *[f"ppl {k} (BF16 {result['bf16'][k]:.3f})" for k in keys], "verify attn err", "verify logit err"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        cells = [f"{r['ppl'][k]:.3f} ({100 * (r['ppl'][k] / result['bf16'][k] - 1):+.2f}%)" for k in keys]
        lines.append(f"| {r['variant']} | " + " | ".join(cells) + f" | {r['verify_attn']:.4f} | {r['verify_logit']:.4f} |")
    return f"{result['model_id']} ({result['config']})\n\n" + "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
