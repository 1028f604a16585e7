"""The value checks of an artifact's tensors: finite, orthogonal rotations, clips in (0, 1],
descending eigenvalues, one rotation per layer for granularity ``layer``. They run in numpy
(float64 where they compute) on numpy arrays or torch tensors, and import no torch.

They live in the contract layer so that every reader refuses a bad artifact, not only ``oscar
validate``: :func:`oscar_calib.spec.artifact.load_artifact` runs them, and ``oscar validate``
(:mod:`oscar_calib.tools.validate`) reports them with its other checks.
"""

from __future__ import annotations

import numpy as np

from .artifact import SHARED_KINDS, TENSOR_KINDS, layer_group_problems, tensor_name
from .defaults import ORTHOGONALITY_TOL

EIGENVALUE_TOL = 1e-6        # relative to the head's largest |eigenvalue|


def check_values(tensors: dict, md: dict[str, str]) -> dict[str, list[str]]:
    """Finite values, orthogonality, clip range, eigenvalue order, per-layer granularity, per-layer
    group sizes (``layer_group_sizes`` and ``layer_v_group_sizes``, when stored).
    Assumes :func:`check_structure` passed; ``tensors`` are numpy arrays or torch tensors (an
    in-memory artifact's, on any device). Returns problems per check name."""
    out = {"finite": [], "orthogonal": [], "clips": [], "eigenvalues": [], "granularity": [],
           "group_sizes": layer_group_problems(md)}
    n = int(md["num_layers"])
    per_layer = md.get("granularity") == "layer"
    for i in range(n):
        t = {k: _numpy(tensors[tensor_name(i, k)]) for k in TENSOR_KINDS + SHARED_KINDS
             if tensor_name(i, k) in tensors}
        for k, x in t.items():
            bad = int(np.count_nonzero(~np.isfinite(x)))
            if bad:
                out["finite"].append(f"{tensor_name(i, k)} has {bad} non-finite value(s)")
        for k in ("k_rotation", "v_rotation", "k_layer_rotation", "v_layer_rotation"):
            r = t.get(k)
            if r is None or not np.isfinite(r).all():
                continue
            r64 = r.astype(np.float64)
            err = np.abs(r64 @ np.swapaxes(r64, -1, -2) - np.eye(r.shape[-1])).max(axis=(-1, -2)).reshape(-1)
            worst = int(err.argmax())
            if float(err[worst]) >= ORTHOGONALITY_TOL:
                where = f" on KV head {worst}" if r.ndim == 3 else ""
                out["orthogonal"].append(f"{tensor_name(i, k)} is not orthogonal: ‖RRᵀ − I‖∞ = "
                                         f"{float(err[worst]):.2e}{where} (limit {ORTHOGONALITY_TOL:g})")
            if per_layer and r.ndim == 3 and r.shape[0] > 1 and not np.allclose(r, r[:1], atol=1e-6, rtol=0):
                out["granularity"].append(f"{tensor_name(i, k)} differs between KV heads but granularity is 'layer'")
        for k in ("k_clip", "v_clip"):
            c = t[k]
            bad = ~((c > 0) & (c <= 1)) & np.isfinite(c)
            if bad.any():
                out["clips"].append(f"{tensor_name(i, k)} has ratio(s) outside (0, 1]: "
                                    f"{', '.join(f'{float(v):g}' for v in c[bad][:4])}")
        for k in ("k_eigenvalues", "v_eigenvalues", "k_layer_eigenvalues", "v_layer_eigenvalues"):
            if k not in t:
                continue
            e = t[k].astype(np.float64)
            if not np.isfinite(e).all() or e.shape[-1] < 2:
                continue
            scale = np.maximum(np.abs(e).max(axis=-1, keepdims=True), 1e-30)
            rise = ((e[..., 1:] - e[..., :-1]) / scale).max()
            if float(rise) > EIGENVALUE_TOL:
                out["eigenvalues"].append(f"{tensor_name(i, k)} is not in descending order")
    return out


def _numpy(x) -> np.ndarray:
    """A numpy view of an array or of a torch tensor (detached, on the CPU), without importing torch."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        try:
            x = x.numpy()
        except TypeError:                       # bfloat16 / FP8: numpy has no such dtype
            x = x.float().numpy()
    return np.asarray(x)


def value_problems(tensors: dict, md: dict[str, str]) -> list[str]:
    """Every problem :func:`check_values` finds, in its order (finite first)."""
    return [p for found in check_values(tensors, md).values() for p in found]
