#!/usr/bin/env python
"""Does rotation refinement (``numerics.refine``) generalise beyond the rows it is fitted on?

    python scripts/experiments/refine_generalisation.py one     # fit + choose on 1 sequence, measure on 2 others
    python scripts/experiments/refine_generalisation.py split   # fit on 6, choose on 2, measure on 2 others

SmolLM2-135M, the default calibration (8192 tokens of the embedded calibration half, seed 0) with
3 (``one``) or 10 (``split``) held-out sequences of 512 rows; layers 3, 12 and 24. For each KV head
it prints the exact refinement objective (relative squared attention-output error under INT2,
sink 64 exact: ``refine.exact_error``) before -> after on the rows that fit/choose, and on rows
never used. One thread. Statistics are cached in ``runs/ablation/`` (as ``ablation.py`` does).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "experiments"))

EXPERIMENTS = {
    # name: (held-out sequences, fit, choose (None: the fit rows), measure, heads per layer, (steps, lr) settings)
    "one": (3, [0], None, [1, 2], 3, ((16, 2e-3), (64, 5e-4), (64, 1e-4), (64, 2e-3))),
    "split": (10, [0, 1, 2, 3, 4, 5], [6, 7], [8, 9], 2, ((32, 5e-4), (32, 2e-3))),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("experiment", choices=sorted(EXPERIMENTS))
    args = ap.parse_args()
    import torch
    from ablation import stats_run

    from oscar_calib.calibration.fit import build_rotations, heldout_layer
    from oscar_calib.calibration.pipeline import prepare_model
    from oscar_calib.contract.config import CalibrationConfig
    from oscar_calib.numerics.refine import (
        HeadRows,
        RefineSettings,
        exact_error,
        refine_rotations,
    )

    torch.set_num_threads(1)
    n, fit, choose, measure, heads, settings = EXPERIMENTS[args.experiment]
    cfg = CalibrationConfig(model="smollm2-135m", device="cpu", heldout_seqs=n)
    lm = prepare_model(cfg)
    run, _ = stats_run(lm, cfg, ROOT / "runs" / "ablation" / f"smollm2-135m.h{n}.stats.pt")
    layers, _ = build_rotations(run, cfg, lm.geometry, 64)
    ratios: dict = {}
    for li in (3, 12, 24):
        held, lr_ = heldout_layer(run, li), layers[li]
        for h in range(heads):
            rows_fit = HeadRows.of_layer(held, h, fit)
            rows_choose = None if choose is None else HeadRows.of_layer(held, h, choose)
            rows_test = HeadRows.of_layer(held, h, measure)
            rk0, rv0 = lr_.k_rotation[h].double(), lr_.v_rotation[h].double()
            ck, cv = float(lr_.k_clip[h]), float(lr_.v_clip[h])
            t0 = exact_error(rows_test, rk0, ck, rv0, cv, 64, 64)
            out = []
            for steps, lr in settings:
                rk, rv, rep = refine_rotations(rows_fit, rk0, ck, rv0, cv, 64, RefineSettings(steps, lr, 64),
                                               valid=rows_choose)
                t1 = exact_error(rows_test, rk, ck, rv, cv, 64, 64)
                ratios.setdefault((steps, lr), []).append(t1 / t0)
                out.append(f"{steps}@{lr:g}: chosen-on {rep['before']:.4f}->{rep['after']:.4f} (step "
                           f"{rep['best_step']}) unseen {t0:.4f}->{t1:.4f}")
            print(f"layer {li} head {h}: " + " | ".join(out), flush=True)
    for (steps, lr), v in ratios.items():
        print(f"{steps} steps at lr {lr:g}: unseen objective after/before, mean over heads {sum(v) / len(v):.3f}")


if __name__ == "__main__":
    main()
