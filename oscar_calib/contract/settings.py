"""The artifact's settings, typed: parsed and validated once, rendered by the same object.

Everything an artifact stores besides its tensors and its provenance (model id and fingerprint,
calibration record, toolkit version, model source, digest) is a field of
:class:`ArtifactSettings`. A reader gets it from :meth:`ArtifactSettings.read` (every problem, for
``oscar validate``) or :meth:`ArtifactSettings.from_metadata` (the first problem, raised); a writer
builds one and stores :meth:`ArtifactSettings.metadata`. Construction runs the same checks as
reading (:meth:`ArtifactSettings.problems`), so a writer cannot produce what a reader refuses, and
every other module takes the typed values instead of re-parsing strings.

Fields and their metadata keys (what each means: the artifact reference, docs/reference/artifact.md):
the geometry ``num_layers``, ``num_attention_heads``, ``num_kv_heads``, ``head_dim`` (same keys);
``group_size`` (the uniform size; with per-layer sizes, the closest uniform size within the same
bit budget); ``layer_groups``, every layer's :class:`GroupPair` (``layer_group_sizes``,
``layer_v_group_sizes``, stored where they differ from ``group_size``); ``sink_tokens``,
``recent_tokens``; ``logit_correction`` (stored when on); ``granularity``, ``composition``,
``k_objective``, ``v_objective``; ``v_folded``; ``key_centering`` (``k_centered``, with
``layers.{i}.k_mean``) and ``key_center_fit`` (``k_center_fit``: ``centered`` or ``raw``,
``defaults.CENTER_FITS``); ``shared_clips`` (``fork_k_clip``, ``fork_v_clip``); ``model_type``;
``layer_ids`` (stored when not ``0..n-1``); ``layer_head_dims``, ``layer_kv_heads`` (stored where
some layer differs from layer 0, whose sizes ``head_dim`` / ``num_kv_heads`` hold).

Export targets declare which of these their engine serves (:data:`.features.FEATURES`, read by
:mod:`oscar_calib.tools.export.base`). A new setting is one field here, its key in
:mod:`.layout`, its check in :meth:`ArtifactSettings.problems` and, when an engine could fail to
honour it, one :class:`~.features.Feature`.

Importing this module does not import torch.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import ArtifactError
from .defaults import (
    BITS,
    CENTER_FITS,
    COMPOSITIONS,
    GRANULARITIES,
    HEAD_DIM_MULTIPLE,
    K_OBJECTIVES,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_WINDOW_TOKENS,
    V_OBJECTIVES,
    centering_problem,
    group_pair,
    group_size_problem,
    logit_correction_problem,
)
from .layout import (
    IMPORTED,
    KEY_CENTER_FIT_METADATA,
    KEY_CENTERING_METADATA,
    LAYER_GROUPS_METADATA,
    LAYER_HEAD_DIMS_METADATA,
    LAYER_IDS_METADATA,
    LAYER_KV_HEADS_METADATA,
    LAYER_V_GROUPS_METADATA,
    LOGIT_CORRECTION_METADATA,
    SHARED_CLIP_METADATA,
    V_FOLDED_METADATA,
)

INT_LIMIT = 2 ** 31          # every integer field: what an int32 holds (kernels index with int32)
# transformers' model types: a letter, then letters, digits, '_' or '-' ("llama", "gemma3_text", "gpt-sw3")
MODEL_TYPE = re.compile(r"[A-Za-z][A-Za-z0-9_\-]{0,63}")
_DIGITS = re.compile(r"[0-9]{1,30}")
# transformers model types whose layers also keep a recurrent state (linear attention, short convolution, Mamba):
# hybrid models, whose attention layers alone have artifact layers (Falcon-H1: every layer has both)
STATE_MODEL_TYPES = ("falcon_h1", "lfm2", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


class GroupPair(NamedTuple):
    """One layer's INT2 group sizes: ``k`` for the keys, ``v`` for the values (a tuple ``(k, v)``)."""

    k: int
    v: int

    @classmethod
    def of(cls, k: int, v: int | None = None) -> "GroupPair":
        """The pair ``(k, v)``; the values take the keys' size when ``v`` is None
        (:func:`~.defaults.group_pair`, the one place where "V defaults to K" is decided)."""
        return cls(*group_pair(k, v))

    @property
    def split(self) -> bool:
        return self.k != self.v


@dataclass(frozen=True)
class ArtifactSettings:
    """Every setting of an artifact, typed and valid (see the module docstring). ``layer_groups``
    may be given empty: every layer then uses ``group_size`` for keys and values; ``layer_ids``,
    ``layer_head_dims`` and ``layer_kv_heads`` likewise (``0..n-1``, ``head_dim``, ``num_kv_heads``)."""

    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    group_size: int
    sink_tokens: int
    recent_tokens: int
    layer_groups: tuple[GroupPair, ...] = ()
    logit_correction: float = 0.0
    granularity: str = "head"
    composition: str = IMPORTED
    k_objective: str = IMPORTED
    v_objective: str = IMPORTED
    v_folded: bool = False
    key_centering: bool = False
    key_center_fit: str = "centered"
    shared_clips: tuple[float, float] | None = None
    model_type: str | None = None
    layer_ids: tuple[int, ...] = ()
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        groups = tuple(GroupPair.of(*g) for g in self.layer_groups) or \
            (GroupPair.of(self.group_size),) * self.num_layers
        object.__setattr__(self, "layer_groups", groups)
        n = self.num_layers
        for name, default in (("layer_ids", range(n)), ("layer_head_dims", [self.head_dim] * n),
                              ("layer_kv_heads", [self.num_kv_heads] * n)):
            object.__setattr__(self, name, tuple(int(x) for x in (getattr(self, name) or default)))
        if isinstance(self.logit_correction, int) and not isinstance(self.logit_correction, bool):
            object.__setattr__(self, "logit_correction", float(self.logit_correction))
        if self.shared_clips is not None:
            object.__setattr__(self, "shared_clips", tuple(float(c) for c in self.shared_clips))
        problems = self.problems()
        if problems:
            raise ArtifactError(problems[0])

    # -- reading --------------------------------------------------------------------------------
    @classmethod
    def read(cls, md: dict[str, str]) -> tuple["ArtifactSettings | None", list[str]]:
        """Parse the settings in metadata ``md``: ``(settings, [])``, or ``(None, problems)`` with
        every problem found (a missing key, a malformed value, a value out of bounds)."""
        problems: list[str] = []
        values = _parse(md, problems)
        if problems:
            return None, problems
        problems = _problems(values)
        if problems:
            return None, problems
        return cls(**values), []

    @classmethod
    def from_metadata(cls, md: dict[str, str]) -> "ArtifactSettings":
        """The settings of ``md``, or :class:`ArtifactError` with the first problem."""
        settings, problems = cls.read(md)
        if problems:
            raise ArtifactError(problems[0])
        return settings

    def replace(self, **changes) -> "ArtifactSettings":
        """A copy with ``changes`` (validated like any other construction)."""
        return dataclasses.replace(self, **changes)

    # -- writing --------------------------------------------------------------------------------
    def metadata(self) -> dict[str, str]:
        """The metadata strings of these settings (optional keys only where they say something)."""
        md = {"num_layers": str(self.num_layers), "num_attention_heads": str(self.num_attention_heads),
              "num_kv_heads": str(self.num_kv_heads), "head_dim": str(self.head_dim),
              "group_size": str(self.group_size), "bits": str(BITS), "sink_tokens": str(self.sink_tokens),
              "recent_tokens": str(self.recent_tokens), "k_objective": self.k_objective,
              "v_objective": self.v_objective, "composition": self.composition, "granularity": self.granularity}
        if self.per_layer_groups:
            md[LAYER_GROUPS_METADATA] = ",".join(str(g.k) for g in self.layer_groups)
        if self.split_groups:
            md[LAYER_V_GROUPS_METADATA] = ",".join(str(g.v) for g in self.layer_groups)
        if self.logit_correction:
            md[LOGIT_CORRECTION_METADATA] = f"{self.logit_correction:g}"
        if self.v_folded:
            md[V_FOLDED_METADATA] = "true"
        if self.key_centering:
            md[KEY_CENTERING_METADATA] = "true"
            if self.key_center_fit != "centered":       # absent reads as centered: a file written before
                md[KEY_CENTER_FIT_METADATA] = self.key_center_fit   # the key round-trips unchanged
        if self.shared_clips is not None:
            md.update(zip(SHARED_CLIP_METADATA, (f"{c:g}" for c in self.shared_clips)))
        if self.model_type is not None:
            md["model_type"] = self.model_type
        if self.mapped_layers:
            md[LAYER_IDS_METADATA] = ",".join(map(str, self.layer_ids))
        if self.mixed_heads:
            md[LAYER_HEAD_DIMS_METADATA] = ",".join(map(str, self.layer_head_dims))
            md[LAYER_KV_HEADS_METADATA] = ",".join(map(str, self.layer_kv_heads))
        return md

    # -- derived --------------------------------------------------------------------------------
    @property
    def k_groups(self) -> list[int]:
        return [g.k for g in self.layer_groups]

    @property
    def v_groups(self) -> list[int]:
        return [g.v for g in self.layer_groups]

    @property
    def per_layer_groups(self) -> bool:
        """Some layer's keys use another size than ``group_size`` (a bit budget spent unevenly)."""
        return any(g.k != self.group_size for g in self.layer_groups)

    @property
    def split_groups(self) -> bool:
        """Some layer stores its values in groups of another size than its keys."""
        return any(g.split for g in self.layer_groups)

    @property
    def uniform_groups(self) -> bool:
        """Keys and values of every layer in groups of ``group_size``."""
        return not (self.per_layer_groups or self.split_groups)

    @property
    def per_head(self) -> bool:
        """One rotation per KV head (not one shared by a layer's heads)."""
        return self.granularity == "head" and max(self.layer_kv_heads) > 1

    @property
    def mapped_layers(self) -> bool:
        """The artifact's layers are not the model's layers 0..n-1 (a hybrid model's attention layers)."""
        return self.layer_ids != tuple(range(self.num_layers))

    @property
    def hybrid(self) -> bool:
        """A hybrid model's artifact: its layers are the model's attention layers, beside layers that keep a
        recurrent state (:data:`STATE_MODEL_TYPES`, or layers mapped to other ids)."""
        return self.mapped_layers or self.model_type in STATE_MODEL_TYPES

    @property
    def mixed_heads(self) -> bool:
        """Some layer's head_dim or KV-head count differs from layer 0's."""
        return len(set(zip(self.layer_head_dims, self.layer_kv_heads))) > 1

    def layer_heads(self, i: int) -> tuple[int, int]:
        """``(num_kv_heads, head_dim)`` of layer ``i``."""
        return self.layer_kv_heads[i], self.layer_head_dims[i]

    # -- checks ---------------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """Why these typed values are not a valid artifact's (empty when they are)."""
        return _problems({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})


# ----------------------------------------------------------------------------- parsing

_INT_KEYS = ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "group_size", "sink_tokens",
             "recent_tokens")


def metadata_int(md: dict[str, str], key: str) -> int | None:
    """The integer value of ``key`` (ASCII digits only), None when absent or not such a number."""
    v = str(md.get(key, ""))
    return int(v) if _DIGITS.fullmatch(v) else None


def _parse(md: dict[str, str], problems: list[str]) -> dict:
    """The typed values of ``md``'s settings; syntax problems are appended to ``problems``."""
    out: dict = {}
    for k in _INT_KEYS:
        if k not in md:
            problems.append(f"metadata missing {k}")
            continue
        v = metadata_int(md, k)
        if v is None:
            problems.append(f"metadata {k!r} is not a non-negative integer: {str(md[k])[:40]!r}")
        elif v >= INT_LIMIT:
            problems.append(f"metadata {k!r} is {v}, beyond any model (limit {INT_LIMIT - 1})")
        else:
            out[k] = v
    if "bits" in md and metadata_int(md, "bits") != BITS:
        problems.append(f"metadata 'bits' is {str(md['bits'])[:40]}, format v1 stores 2-bit settings only")
    for k in ("granularity", "composition", "k_objective", "v_objective"):
        if k in md:
            out[k] = str(md[k])
    n = out.get("num_layers")
    ks, vs = (_sizes(md, key, n, problems) for key in (LAYER_GROUPS_METADATA, LAYER_V_GROUPS_METADATA))
    if (ks or vs) and n is not None and "group_size" in out:
        ks = ks or [out["group_size"]] * n
        out["layer_groups"] = tuple(GroupPair.of(k, v) for k, v in zip(ks, vs or ks))
    if LOGIT_CORRECTION_METADATA in md:
        raw = md[LOGIT_CORRECTION_METADATA]
        try:
            gain = float(raw)
        except ValueError:
            gain = raw
        why = logit_correction_problem(gain, f"metadata {LOGIT_CORRECTION_METADATA!r}")
        if why:
            problems.append(why.replace(repr(gain), repr(raw)))
        else:
            out["logit_correction"] = gain
    for key, name in ((V_FOLDED_METADATA, "v_folded"), (KEY_CENTERING_METADATA, "key_centering")):
        flag = md.get(key, "false")
        if flag not in ("true", "false"):
            problems.append(f"metadata {key!r} is {str(flag)[:40]!r}, expected 'true' or 'false'")
        out[name] = flag == "true"
    if KEY_CENTER_FIT_METADATA in md:
        out["key_center_fit"] = str(md[KEY_CENTER_FIT_METADATA])
    present = [k for k in SHARED_CLIP_METADATA if k in md]
    if present and len(present) != len(SHARED_CLIP_METADATA):
        problems.append(f"metadata has {present[0]!r} without {[k for k in SHARED_CLIP_METADATA if k not in md][0]!r}")
    elif present:
        clips = []
        for k in SHARED_CLIP_METADATA:
            try:
                clips.append(float(md[k]))
            except ValueError:
                clips.append(float("nan"))          # refused with the range below
        out["shared_clips"] = tuple(clips)
    if "model_type" in md:
        out["model_type"] = str(md["model_type"])
    for key in (LAYER_IDS_METADATA, LAYER_HEAD_DIMS_METADATA, LAYER_KV_HEADS_METADATA):
        values = _sizes(md, key, n, problems)
        if values is not None:
            out[key] = tuple(values)
    return out


def _sizes(md: dict[str, str], key: str, n: int | None, problems: list[str]) -> list[int] | None:
    """The per-layer integers under ``key`` (None when absent or unreadable: then a problem is added)."""
    raw = md.get(key)
    if raw is None:
        return None
    parts = str(raw).split(",")
    if not all(_DIGITS.fullmatch(x.strip()) for x in parts):
        problems.append(f"metadata {key!r} is not comma-separated integers: {raw[:60]!r}")
        return None
    if n is not None and len(parts) != n:
        problems.append(f"metadata {key!r} has {len(parts)} {'ids' if key == LAYER_IDS_METADATA else 'sizes'} for "
                        f"{n} layers")
        return None
    return [int(x) for x in parts]


def _problems(v: dict) -> list[str]:
    """Every bound and rule the typed values ``v`` (field name -> value) break."""
    problems = []
    n, h, kv, d, g = (v.get(k) for k in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim",
                                          "group_size"))
    for k in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "group_size"):
        if v.get(k) == 0:
            problems.append(f"metadata {k!r} must be positive")
    for k, cap in (("num_layers", MAX_LAYERS), ("num_attention_heads", MAX_HEADS), ("head_dim", MAX_HEAD_DIM)):
        if v.get(k) is not None and v[k] > cap:
            problems.append(f"metadata {k!r} is {v[k]}, above the toolkit's limit of {cap}")
    problems += _layer_problems(v)
    dims = v.get("layer_head_dims") or ([d] if d else [])
    heads = v.get("layer_kv_heads") or ([kv] if kv else [])
    for x in sorted(set(heads)):
        if h and x and h % x:
            problems.append(f"{h} query heads do not split evenly over {x} KV heads")
    for x in sorted(set(dims)):
        if x and x % HEAD_DIM_MULTIPLE:
            problems.append(f"head_dim {x} is not a multiple of {HEAD_DIM_MULTIPLE} (the INT2 cache packs four 2-bit "
                            "codes per byte)")
    if g:
        why = next((w for w in (group_size_problem(g, x or None) for x in sorted(set(dims)) or [None]) if w), None)
        if why:
            problems.append(f"group_size {why}")
    sink, recent = v.get("sink_tokens"), v.get("recent_tokens")
    if sink is not None and recent is not None and sink + recent > MAX_WINDOW_TOKENS:
        problems.append(f"BF16 windows of {sink} sink + {recent} recent tokens exceed the limit of {MAX_WINDOW_TOKENS} "
                        "tokens (longer than any supported model's context)")
    if v.get("granularity", "head") not in GRANULARITIES:
        problems.append(f"unknown granularity {v.get('granularity')!r} (expected one of {', '.join(GRANULARITIES)})")
    for k, valid in (("composition", COMPOSITIONS), ("k_objective", K_OBJECTIVES), ("v_objective", V_OBJECTIVES)):
        if v.get(k, IMPORTED) not in (*valid, IMPORTED):
            problems.append(f"unknown {k} {v.get(k)!r}")
    groups = v.get("layer_groups") or ()
    if groups and n is not None and len(groups) != n:
        problems.append(f"{len(groups)} layer group sizes for {n} layers")
    elif groups:
        per_d = dims if len(dims) == len(groups) else [d] * len(groups)
        for key, sizes in ((LAYER_GROUPS_METADATA, [p.k for p in groups]), (LAYER_V_GROUPS_METADATA,
                                                                            [p.v for p in groups])):
            bad = next((why for why in (group_size_problem(s, x or None) for s, x in zip(sizes, per_d)) if why), None)
            if bad:
                problems.append(f"metadata {key!r}: {bad}")
    a = v.get("logit_correction", 0.0)
    why = logit_correction_problem(a, f"metadata {LOGIT_CORRECTION_METADATA!r}")
    if why:
        problems.append(why)
    clips = v.get("shared_clips")
    if clips is not None and len(clips) != len(SHARED_CLIP_METADATA):
        problems.append(f"shared clip ratios {clips!r} must be a (K, V) pair")
    elif clips is not None:
        problems += [f"metadata {k!r} is {c:g}, expected a clip ratio in (0, 1]"
                     for k, c in zip(SHARED_CLIP_METADATA, clips) if not 0 < c <= 1]
    fit = v.get("key_center_fit", "centered")
    if fit not in CENTER_FITS:
        problems.append(f"metadata {KEY_CENTER_FIT_METADATA!r} is {str(fit)[:40]!r}, expected one of "
                        f"{', '.join(CENTER_FITS)}")
    elif fit != "centered" and not v.get("key_centering"):
        problems.append(f"metadata {KEY_CENTER_FIT_METADATA!r} is {fit!r} but the keys are not centered "
                        f"({KEY_CENTERING_METADATA!r} is not 'true')")
    mt = v.get("model_type")
    why = centering_problem(mt) if v.get("key_centering") else None
    if why:
        problems.append(why)
    if mt is not None and not MODEL_TYPE.fullmatch(str(mt)):
        problems.append(f"metadata 'model_type' is {str(mt)[:40]!r}, not a transformers model type (a letter, then "
                        "letters, digits, '_' or '-')")
    return problems


def _layer_problems(v: dict) -> list[str]:
    """The per-layer mapping and head geometry: ``layer_ids`` increasing from 0 and below
    :data:`MAX_LAYERS`; ``layer_head_dims`` / ``layer_kv_heads`` one per layer, within the bounds of
    ``head_dim`` / ``num_kv_heads``, and starting with them (layer 0's)."""
    problems, n = [], v.get("num_layers")
    for key in (LAYER_IDS_METADATA, LAYER_HEAD_DIMS_METADATA, LAYER_KV_HEADS_METADATA):
        values = tuple(v.get(key) or ())
        if values and n is not None and len(values) != n:
            problems.append(f"metadata {key!r} has {len(values)} {'ids' if key == LAYER_IDS_METADATA else 'sizes'} "
                            f"for {n} layers")
            continue
        if not values:
            continue
        if key == LAYER_IDS_METADATA:
            if values[0] < 0 or any(b <= a for a, b in zip(values, values[1:])):
                problems.append(f"metadata {key!r} must be increasing decoder-layer indices, got "
                                f"{','.join(map(str, values))[:60]}")
            elif values[-1] >= MAX_LAYERS:
                problems.append(f"metadata {key!r} names layer {values[-1]}, above the toolkit's limit of "
                                f"{MAX_LAYERS - 1}")
            continue
        name, cap = ("head_dim", MAX_HEAD_DIM) if key == LAYER_HEAD_DIMS_METADATA else ("num_kv_heads", MAX_HEADS)
        if any(x <= 0 or x > cap for x in values):
            problems.append(f"metadata {key!r} must hold values in 1..{cap}, got {','.join(map(str, values))[:60]}")
        elif v.get(name) is not None and values[0] != v[name]:
            problems.append(f"metadata {key!r} starts with {values[0]} but {name} (layer 0's) is {v[name]}")
    return problems
