"""Per-model YAML configs (``configs/*.yaml``): attention geometry plus recommended calibration.

A file has two sections and an optional third, all typed and rejecting unknown keys::

    geometry:      # GeometrySpec: the published model's attention geometry
      model_id: Qwen/Qwen3-8B
      model_type: qwen3           # transformers' config.model_type
      num_layers: 36
      num_attention_heads: 32
      num_kv_heads: 8
      head_dim: 128
      hidden_size: 4096
      ...
      hf_config: {...}            # further transformers config fields (family-specific names)
      tiny: {...}                 # overrides for the random-init test model (MoE sizes, ...)
    calibration:   # oscar_calib.contract.config.CalibrationConfig (what `oscar calibrate --config` reads)
      model: Qwen/Qwen3-8B
      tokens: 32768
      ...
    rotationzoo:   # optional, RotationZooSpec: OSCAR's published rotations for it (`oscar pull rotationzoo:NAME`)
      tag: seq20000_prompt83_group128
      k_clip: 0.96
      v_clip: 0.92

:meth:`GeometrySpec.to_hf_config` builds a transformers config from the geometry, full size or
tiny (2 layers, narrow hidden size, the real query heads, KV heads and head_dim), so tests and
benchmarks can instantiate every covered architecture without its weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from ..contract.config import (
    CalibrationConfig,
    check_known_keys,
    from_mapping,
    load_yaml_mapping,
)
from ..errors import InputError

SECTIONS = ("geometry", "calibration", "rotationzoo")
ROTATIONZOO_REPO = "Zhongzhu/OSCAR-RotationZoo"      # OSCAR's published rotations on the Hugging Face hub
FORK_WINDOW_MULTIPLE = 8                             # the fork's page size: sink and recent are multiples of it
QK_NORMS = (None, "head", "layer")    # RMSNorm over each head's q/k, over the whole projection, or none
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")   # what a layer_pattern may name

# the random-init test model: narrow, short, small vocabulary; heads and head_dim stay real
TINY_DEFAULTS = {"num_layers": 2, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 256,
                 "max_position_embeddings": 1024}


@dataclass(frozen=True)
class GeometrySpec:
    """Attention geometry of a published model (numbers from its ``config.json``)."""

    model_type: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    model_id: str = ""
    intermediate_size: int | None = None
    vocab_size: int | None = None
    max_position_embeddings: int | None = None
    layer_pattern: tuple[str, ...] | None = None   # repeated over the layers; None: all full attention
    sliding_window: int | None = None
    # a hybrid's linear-attention layers are ``linear_attention`` in the pattern (no KV cache: no artifact layer);
    # full-attention layers whose head geometry differs from the others' (Gemma 4: global_head_dim and
    # num_global_key_value_heads, the latter with attention_k_eq_v)
    full_head_dim: int | None = None
    full_kv_heads: int | None = None
    attention_bias: bool = False
    qk_norm: str | None = None                     # see QK_NORMS
    partial_rotary_factor: float = 1.0             # share of head_dim that RoPE rotates
    hf_config: dict = field(default_factory=dict)
    tiny: dict = field(default_factory=dict)

    def validate(self, where: str = "geometry") -> "GeometrySpec":
        for name in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "hidden_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise InputError(f"{where}: {name} must be a positive integer, got {v!r}")
        if self.num_attention_heads % self.num_kv_heads:
            raise InputError(f"{where}: {self.num_attention_heads} query heads do not split over "
                             f"{self.num_kv_heads} KV heads")
        if self.qk_norm not in QK_NORMS:
            raise InputError(f"{where}: qk_norm must be one of head, layer or null, got {self.qk_norm!r}")
        if not 0 < float(self.partial_rotary_factor) <= 1:
            raise InputError(f"{where}: partial_rotary_factor must be in (0, 1]")
        for lt in self.layer_pattern or ():
            if lt not in LAYER_TYPES:
                raise InputError(f"{where}: unknown layer type {lt!r} in layer_pattern (one of "
                                 f"{', '.join(LAYER_TYPES)})")
        if self.layer_pattern and not set(self.layer_pattern) - {"linear_attention"}:
            raise InputError(f"{where}: layer_pattern has no attention layer")
        for name in ("full_head_dim", "full_kv_heads"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise InputError(f"{where}: {name} must be a positive integer, got {v!r}")
        if self.full_kv_heads and self.num_attention_heads % self.full_kv_heads:
            raise InputError(f"{where}: {self.num_attention_heads} query heads do not split over {self.full_kv_heads} "
                             "KV heads of the full-attention layers")
        if self.layer_pattern and "sliding_attention" in self.layer_pattern and not self.sliding_window:
            raise InputError(f"{where}: sliding layers need sliding_window")
        unknown = set(self.tiny) - set(TINY_DEFAULTS) - {"layer_types", "hf_config"}
        if unknown:
            raise InputError(f"{where}: unknown key(s) in tiny: {', '.join(sorted(unknown))}; valid: "
                             f"{', '.join(sorted([*TINY_DEFAULTS, 'layer_types', 'hf_config']))}")
        return self

    @property
    def gqa_group(self) -> int:
        return self.num_attention_heads // self.num_kv_heads

    def layer_types(self, num_layers: int | None = None) -> tuple[str, ...]:
        n = num_layers or self.num_layers
        pattern = self.layer_pattern or ("full_attention",)
        return tuple(pattern[i % len(pattern)] for i in range(n))

    def layer_heads(self, kind: str) -> tuple[int, int]:
        """``(KV heads, head_dim)`` of a layer of ``kind``."""
        if kind == "full_attention":
            return self.full_kv_heads or self.num_kv_heads, self.full_head_dim or self.head_dim
        return self.num_kv_heads, self.head_dim

    def to_geometry(self):
        """The :class:`oscar_calib.model.load.Geometry` that ``geometry_of`` reports for the real model
        (a hybrid's attention layers only; per-layer heads where the full-attention layers differ)."""
        from .geometry import Geometry

        types = self.layer_types()
        ids = tuple(i for i, t in enumerate(types) if t != "linear_attention")
        heads = [self.layer_heads(types[i]) for i in ids]
        mixed = len(set(heads)) > 1
        return Geometry(self.model_type, len(ids), self.num_attention_heads, heads[0][0], heads[0][1],
                        tuple(types[i] for i in ids), self.sliding_window if self.layer_pattern else None,
                        layer_ids=None if ids == tuple(range(len(ids))) else ids,
                        layer_head_dims=tuple(d for _, d in heads) if mixed else None,
                        layer_kv_heads=tuple(h for h, _ in heads) if mixed else None)

    def config_kwargs(self, *, tiny: bool = False) -> dict:
        """Keyword arguments for ``transformers.AutoConfig.for_model(model_type, **kwargs)``."""
        sizes = {"num_layers": self.num_layers, "hidden_size": self.hidden_size,
                 "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
                 "max_position_embeddings": self.max_position_embeddings}
        layer_types = list(self.layer_types())
        extra = dict(self.hf_config)
        if tiny:
            sizes.update(TINY_DEFAULTS)
            sizes.update({k: v for k, v in self.tiny.items() if k in TINY_DEFAULTS})
            layer_types = list(self.tiny.get("layer_types") or self.layer_types(sizes["num_layers"]))
            extra.update(self.tiny.get("hf_config", {}))
        kw = {"num_hidden_layers": sizes.pop("num_layers"), "num_attention_heads": self.num_attention_heads,
              "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim}
        kw.update({k: v for k, v in sizes.items() if v is not None})
        if self.layer_pattern:
            kw["layer_types"] = layer_types
            if self.sliding_window is not None:
                kw["sliding_window"] = self.sliding_window
        if self.full_head_dim is not None:            # Gemma 4's names (transformers' Gemma4TextConfig)
            kw["global_head_dim"] = self.full_head_dim
        if self.full_kv_heads is not None:
            kw.update(num_global_key_value_heads=self.full_kv_heads, attention_k_eq_v=True)
        kw.update(extra)
        return kw

    def to_hf_config(self, *, tiny: bool = False):
        """A ``transformers`` config of this geometry (no weights are created)."""
        from transformers import AutoConfig

        try:
            return AutoConfig.for_model(self.model_type, **self.config_kwargs(tiny=tiny))
        except Exception as e:  # noqa: BLE001 - transformers' validators raise several types
            raise InputError(f"transformers cannot build a {self.model_type!r} config: "
                             f"{str(e).strip().splitlines()[-1].strip()}") from None

    def tiny_model(self, *, seed: int = 0):
        """A random-init causal LM with this geometry at tiny width (float32, eval mode)."""
        import torch

        from .registry import model_class

        torch.manual_seed(seed)
        config = self.to_hf_config(tiny=True)
        model = model_class(config).from_config(config).eval()
        model.requires_grad_(False)
        return model


@dataclass(frozen=True)
class RotationZooSpec:
    """Where OSCAR's own rotations for this model live on the hub and how its scripts serve them
    (``oscar pull rotationzoo:NAME``). ``names``: the model's directory names in the repository
    (matched ignoring case, ``-``, ``_`` and ``.``; default the model id's name); ``tag``: the
    calibration (``seq<T>_prompt<N>_group<G>``) to take when the repository holds several (the one
    its README reports GPQA for); clips, group size and windows: the fork's per-model scripts."""

    repo: str = ROTATIONZOO_REPO
    names: tuple[str, ...] = ()
    tag: str | None = None
    k_clip: float = 0.96
    v_clip: float = 0.92
    group_size: int = 128
    sink: int = 64
    recent: int = 256

    def validate(self, where: str, head_dim: int) -> "RotationZooSpec":
        from ..contract.defaults import check_clip, check_group_size

        if not isinstance(self.repo, str) or self.repo.count("/") != 1:
            raise InputError(f"{where}: repo must be ORG/NAME, got {self.repo!r}")
        if not all(isinstance(n, str) and n for n in self.names):
            raise InputError(f"{where}: names must be non-empty strings")
        try:
            check_clip("k", self.k_clip)
            check_clip("v", self.v_clip)
            check_group_size(head_dim, self.group_size)
        except InputError as e:
            raise InputError(f"{where}: {e}") from None
        for name, n in (("sink", self.sink), ("recent", self.recent)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 0 or n % FORK_WINDOW_MULTIPLE:
                raise InputError(f"{where}: {name} must be a multiple of {FORK_WINDOW_MULTIPLE} tokens (the fork's "
                                 f"page size), got {n!r}")
        if self.recent < FORK_WINDOW_MULTIPLE:
            raise InputError(f"{where}: recent must be at least {FORK_WINDOW_MULTIPLE} tokens")
        return self


@dataclass
class ModelConfig:
    """One ``configs/*.yaml`` file."""

    name: str
    path: Path | None
    geometry: GeometrySpec
    calibration: CalibrationConfig
    rotationzoo: RotationZooSpec | None = None


def geometry_from_mapping(data: dict, *, where: str = "geometry") -> GeometrySpec:
    if not isinstance(data, dict):
        raise InputError(f"{where}: expected a mapping")
    check_known_keys(data, GeometrySpec, where)
    missing = [f.name for f in dataclasses.fields(GeometrySpec)
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in data]
    if missing:
        raise InputError(f"{where}: missing key(s) {', '.join(missing)}")
    values = dict(data)
    if values.get("layer_pattern") is not None:
        values["layer_pattern"] = tuple(values["layer_pattern"])
    for key in ("hf_config", "tiny"):
        if values.get(key) is None:
            values[key] = {}
        elif not isinstance(values[key], dict):
            raise InputError(f"{where}: {key} must be a mapping")
    return GeometrySpec(**values).validate(where)


def load_model_config(path: Path) -> ModelConfig:
    """Read a ``configs/*.yaml`` file; unknown sections or keys are errors that list the valid ones."""
    path = Path(path)
    doc = load_yaml_mapping(path)
    unknown = sorted(set(doc) - set(SECTIONS))
    if unknown:
        raise InputError(f"{path}: unknown section(s) {', '.join(unknown)}; valid: {', '.join(SECTIONS)}")
    if "geometry" not in doc:
        raise InputError(f"{path}: no 'geometry' section")
    geometry = geometry_from_mapping(doc["geometry"], where=f"{path}: geometry")
    cal = doc.get("calibration") or {}
    if not isinstance(cal, dict):
        raise InputError(f"{path}: 'calibration' must be a mapping")
    zoo = None
    if doc.get("rotationzoo") is not None:
        zoo = rotationzoo_from_mapping(doc["rotationzoo"], where=f"{path}: rotationzoo", head_dim=geometry.head_dim)
    return ModelConfig(path.stem, path, geometry, from_mapping(cal, where=f"{path}: calibration"), zoo)


def rotationzoo_from_mapping(data: dict, *, where: str = "rotationzoo", head_dim: int) -> RotationZooSpec:
    if not isinstance(data, dict):
        raise InputError(f"{where}: expected a mapping")
    check_known_keys(data, RotationZooSpec, where)
    values = dict(data)
    if "names" in values:
        if not isinstance(values["names"], (list, tuple)):
            raise InputError(f"{where}: names must be a list")
        values["names"] = tuple(values["names"])
    return RotationZooSpec(**values).validate(where, head_dim)


def configs_dir() -> Path:
    """The ``configs/`` directory of the source checkout (or ``./configs``)."""
    checkout = Path(__file__).resolve().parents[2] / "configs"
    return checkout if checkout.is_dir() else Path("configs")


def load_all(directory: Path | None = None) -> list[ModelConfig]:
    return [load_model_config(p) for p in sorted(Path(directory or configs_dir()).glob("*.yaml"))]
