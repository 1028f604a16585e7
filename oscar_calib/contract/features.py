"""Which artifact settings an engine may fail to honour, and the one line an export says for each.

A :class:`Feature` is a setting of :class:`~.settings.ArtifactSettings` that an engine may not
serve (the logit-noise correction, per-layer or split group sizes, per-head rotations, key centering,
windows, attention sinks, mapped layers, per-layer head sizes). Export targets declare the features their
engine serves (``serves``); :func:`feature_lines` gives the warnings and refusals for the rest, so
no target writes its own checks (:mod:`oscar_calib.tools.export.base`). A new setting an engine
could drop is one :class:`Feature` here.

Importing this module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import InputError
from .defaults import SINK_MODEL_TYPES
from .settings import ArtifactSettings


@dataclass(frozen=True)
class Feature:
    """A setting an artifact may use and an engine may not honour.

    ``active(settings)``: the artifact uses it. An export target lists the features its engine
    serves; for one it does not, ``dropped(settings, engine)`` is the one line the export prints
    (the engine serves the artifact without it), or ``refused`` is True (it cannot be served at all).
    ``covered_by``: a feature whose dropped line already says this one's (not repeated)."""

    name: str
    title: str
    active: Callable[[ArtifactSettings], bool]
    dropped: Callable[[ArtifactSettings, str], str]
    refused: bool = False
    covered_by: str | None = None


def _groups_text(s: ArtifactSettings) -> str:
    ks, vs = s.k_groups, s.v_groups
    if s.split_groups:
        return f"the keys' per-layer sizes {min(ks)}–{max(ks)} and the values' {min(vs)}–{max(vs)}"
    return f"the per-layer sizes {min(ks)}–{max(ks)}"


FEATURES: dict[str, Feature] = {f.name: f for f in (
    Feature("logit_correction", "logit-noise correction",
            lambda s: s.logit_correction > 0,
            lambda s, e: (f"{e} does not subtract the logit-noise correction this artifact asks for (logit_correction "
                          f"{s.logit_correction:g}): it serves the rotations and clips without it")),
    Feature("layer_group_sizes", "per-layer group sizes",
            lambda s: s.per_layer_groups or s.split_groups,
            lambda s, e: (f"{e} takes one group size for every layer and both caches: it serves group "
                          f"{s.group_size} instead of {_groups_text(s)}")),
    Feature("split_group_sizes", "K and V group sizes apart",
            lambda s: s.split_groups,
            lambda s, e: (f"{e} takes one group size per layer for K and V: the values are stored in the keys' "
                          f"groups ({min(s.k_groups)}–{max(s.k_groups)}) instead of their own "
                          f"({min(s.v_groups)}–{max(s.v_groups)})"),
            covered_by="layer_group_sizes"),
    Feature("per_head_rotations", "one rotation per KV head",
            lambda s: s.per_head,
            lambda s, e: (f"{e} loads one rotation per layer: it serves the artifact's shared per-layer rotations, "
                          f"not its {s.num_kv_heads} per-KV-head ones")),
    Feature("key_centering", "key centering",
            lambda s: s.key_centering,
            lambda s, e: (f"{e} does not subtract the mean key (k_mean) this artifact was calibrated with: it serves "
                          + ("the rotations and clips on uncentered keys, whose INT2 groups span a wider range than "
                             "the clips were fitted for" if s.key_center_fit == "centered" else
                             "the rotations, clips and group sizes on uncentered keys, as they were fitted "
                             "(center_fit raw), without what centering gains"))),
    Feature("windows", "BF16 sink and recent window",
            lambda s: s.sink_tokens + s.recent_tokens > 0,
            lambda s, e: (f"{e} keeps no BF16 sink or recent window: the {s.sink_tokens} sink and "
                          f"{s.recent_tokens} recent tokens are stored in INT2 like the rest")),
    Feature("attention_sinks", "attention-sink logits",
            lambda s: s.model_type in SINK_MODEL_TYPES,
            lambda s, e: (f"the model ({s.model_type}) adds a learned attention-sink logit per query head to its "
                          f"softmax, and {e}'s OSCAR decode path was not read for attention sinks, so oscar does not "
                          "write for it"),
            refused=True),
    Feature("layer_ids", "attention layers mapped to the model's layers",
            lambda s: s.mapped_layers,
            lambda s, e: (f"the artifact's {s.num_layers} layers are the model's attention layers "
                          f"{layer_span(s.layer_ids)} (a hybrid model), and {e} was not read to load rotations by "
                          "the model's layer ids, so it could put them on the wrong layers"),
            refused=True),
    Feature("layer_head_dims", "per-layer head sizes",
            lambda s: s.mixed_heads,
            lambda s, e: (f"the model's layers differ in head geometry ({heads_text(s)}), and {e} loads one head_dim "
                          "and KV-head count for every layer"),
            refused=True),
)}


def layer_span(ids) -> str:
    """``3, 7, 11, ...`` (the first eight) of a list of layer ids, ``0..5`` when contiguous."""
    ids = list(ids)
    if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}..{ids[-1]}"
    return ", ".join(map(str, ids[:8])) + (" …" if len(ids) > 8 else "")


def heads_text(s: ArtifactSettings) -> str:
    """Each distinct head geometry of ``s`` and how many layers have it:
    ``50 x (16 KV heads of 256), 10 x (4 KV heads of 512)``."""
    from collections import Counter

    counts = Counter(zip(s.layer_kv_heads, s.layer_head_dims))
    return ", ".join(f"{c} x ({h} KV heads of {d})" for (h, d), c in counts.items())


def feature_lines(settings: ArtifactSettings, serves, engine: str,
                  wording: Callable[[str], str | None] | None = None) -> tuple[list[str], list[str]]:
    """``(warnings, refusals)`` for an engine that serves the features named in ``serves``:
    one line per active feature it does not serve (see :class:`Feature`). ``wording(name)``: the
    engine's own line for a dropped feature, when it has a more precise one (None: the feature's)."""
    served = set(serves)
    unknown = served - set(FEATURES)
    if unknown:
        raise InputError(f"unknown artifact feature(s) {', '.join(sorted(unknown))}; known: {', '.join(FEATURES)}")
    warnings, refusals = [], []
    for f in FEATURES.values():
        if f.name in served or not f.active(settings):
            continue
        if f.covered_by and f.covered_by not in served and FEATURES[f.covered_by].active(settings):
            continue
        line = (wording(f.name) if wording else None) or f.dropped(settings, engine)
        (refusals if f.refused else warnings).append(line)
    return warnings, refusals


__all__ = ["FEATURES", "SINK_MODEL_TYPES", "Feature", "feature_lines", "heads_text", "layer_span"]
