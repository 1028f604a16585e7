#!/usr/bin/env python
"""Why calibrated codebooks lose (docs/design/numerics.md, "What was tried and not adopted"): energy and gain of the
reconstruction on the rows the levels are fitted on, uniform INT2 against fitted levels.

    python scripts/experiments/codebook_gain.py > scripts/experiments/results/codebook_gain_smollm2-135m.md

SmolLM2-135M, the default's rotations and clips from the statistics cached by ``scripts/experiments/ablation.py``
(run it first), held-out rows rotated and clipped per (layer, KV head); averages over layers and heads
of ``E[x̂²]/E[x²]`` and ``E[x·x̂]/E[x²]`` (the gain: below 1, attention logits and outputs shrink).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "experiments"))


def main() -> None:
    import ablation
    import torch

    from oscar_calib.calibration.fit import build_rotations, heldout_layer
    from oscar_calib.calibration.pipeline import prepare_model
    from oscar_calib.contract.config import CalibrationConfig
    from oscar_calib.experimental.codebook import fake_quant_codebook, fit_layer_levels
    from oscar_calib.numerics.quant import clip_rows, fake_quant_int2

    torch.set_num_threads(1)
    base = CalibrationConfig(model="smollm2-135m", device="cpu", seed=0, heldout_seqs=1)
    lm = prepare_model(base)
    run, _ = ablation.stats_run(lm, base, ROOT / "runs" / "ablation" / "smollm2-135m.seed0.h1.stats.pt")
    g = 64
    layers, _ = build_rotations(run, CalibrationConfig(**{**base.to_dict(), "group_size": g}).validate(),
                                lm.geometry, g)
    acc: dict = {}
    for i, lr in enumerate(layers):
        held = heldout_layer(run, i)
        k, v = torch.cat(held.k), torch.cat(held.v)
        for fixed_ends in (False, True):
            kl, vl = fit_layer_levels(k, v, lr.k_rotation, lr.k_clip, lr.v_rotation, lr.v_clip, g, "range",
                                      fixed_ends)
            name = "codebook-inner" if fixed_ends else "codebook"
            for w, x, r, c, lv in (("K", k, lr.k_rotation, lr.k_clip, kl), ("V", v, lr.v_rotation, lr.v_clip, vl)):
                for h in range(x.shape[1]):
                    y = clip_rows(x[:, h].float() @ r[h].float(), float(c[h]))
                    e = float(y.pow(2).mean())
                    cases = [(name, fake_quant_codebook(y, lv[h], g))]
                    if not fixed_ends:
                        cases.append(("uniform INT2 (default)", fake_quant_int2(y, g)))
                    for n, yq in cases:
                        a = acc.setdefault((w, n), [0.0, 0.0, 0])
                        a[0] += float(yq.pow(2).mean()) / e
                        a[1] += float((yq * y).mean()) / e
                        a[2] += 1
    print("| cache | levels | E[x̂²]/E[x²] | gain E[x·x̂]/E[x²] |\n|---|---|---|---|")
    for (w, n), (en, cr, c) in sorted(acc.items()):
        print(f"| {w} | {n} | {en / c:.4f} | {cr / c:.4f} |")


if __name__ == "__main__":
    main()
