"""What an engine with one setting for the whole model is served, for every target: ONE K and ONE
V clip ratio (:func:`serving_clips`; the OSCAR fork, vLLM's, llama.cpp's, mlx-lm's and ONNX
Runtime's pull requests each take one pair), and one group size for every layer and both caches,
with the line that says what that costs (:func:`uniform_group_note`)."""

from __future__ import annotations

from ...contract.artifact import Artifact
from ...contract.defaults import check_clip
from ...errors import ArtifactError
from ...kernels.pack import bits_per_element
from ...numerics.clip import choose_global_clips


def serving_clips(art: Artifact, clip=(None, None), *, per_head: bool = False) -> tuple[float, float, str]:
    """The ONE K and ONE V clip ratio an engine applies to the whole model, and where they come from:
    ``--clip``, else the ratios fitted for the shared rotations, or, for per-KV-head rotations
    (``per_head``: ``sglang-fork-v2``), chosen from the per-head clip tables in ``calibration.json``
    by the same rule, else the artifact's clips when every layer and head has the same."""
    if clip[0] is not None and clip[1] is not None:
        return check_clip("k", clip[0]), check_clip("v", clip[1]), "--clip"
    rows = (art.report or {}).get("layers") or []
    tables = [r.get("clip_tables") or {} for r in rows]
    found, source = None, None
    if per_head and rows and all(t.get("k") is not None and t.get("v") is not None for t in tables):
        found = choose_global_clips([t["k"] for t in tables], [t["v"] for t in tables])
        source = "chosen from the per-head clip tables for per-KV-head rotations"
    elif art.shared_clips() is not None:
        found, source = art.shared_clips(), "fitted for the shared per-layer rotations at calibration"
    else:
        ks = {round(float(c), 6) for lr in art.layers for c in lr.k_clip}
        vs = {round(float(c), 6) for lr in art.layers for c in lr.v_clip}
        if len(ks) == 1 and len(vs) == 1:
            found, source = (ks.pop(), vs.pop()), "the artifact's (equal for every layer and KV head)"
    if found is None:
        raise ArtifactError(f"{art.path}: no global clip ratios recorded (artifact made before oscar 0.2?); "
                            "re-run `oscar calibrate`, or pass --clip k=RATIO,v=RATIO")
    k = check_clip("k", clip[0]) if clip[0] is not None else found[0]
    v = check_clip("v", clip[1]) if clip[1] is not None else found[1]
    return k, v, source if clip == (None, None) else f"{source}, with --clip"


def uniform_group_note(art: Artifact, engine: str = "the fork") -> str | None:
    """One line when the artifact has per-layer group sizes (a bit budget), or keys and values in
    groups of different sizes, which ``engine`` cannot serve (one group size for every layer and
    both caches, the fork's ``--kv-cache-quant-group-size``): the export serves the artifact's
    ``group_size``, the closest uniform size within the budget, and the line says what that costs on
    the calibration's held-out rows (its report's ``bit_budget`` record). None for one size."""
    st = art.settings
    sizes, v_sizes = st.k_groups, st.v_groups
    if st.uniform_groups:
        return None
    g = st.group_size
    b = (art.report or {}).get("bit_budget") or {}
    err = b.get("heldout_attn") or {}
    cost = (f"held-out attention error {err['uniform']:.4f} with group {g} vs {err['per_layer']:.4f} with the "
            f"per-layer sizes ({err['uniform'] / err['per_layer'] - 1:+.1%})" if {"uniform", "per_layer"} <= set(err)
            else "cost not recorded in calibration.json")
    budget = f"the bit budget of {b['bits']:g}" if "bits" in b else "the artifact's budget"
    given = (f"the keys' per-layer sizes {min(sizes)}–{max(sizes)} and the values' {min(v_sizes)}–{max(v_sizes)}"
             if v_sizes != sizes else f"the per-layer sizes {min(sizes)}–{max(sizes)}")
    return (f"{engine} takes one group size for every layer and both caches: exporting group {g} "
            f"({bits_per_element(g):g} bits per element) instead of {given}, the closest uniform scheme within "
            f"{budget}; {cost}")


__all__ = ["serving_clips", "uniform_group_note"]
