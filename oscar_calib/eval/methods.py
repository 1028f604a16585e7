"""The evaluation methods: which KV scheme each one reads through, and its stored bits.

============  ===========================================================================
method        what the KV cache holds
============  ===========================================================================
``bf16``      every K/V row in BF16 (the reference)
``naive``     INT2 history, no rotation, no clip
``hadamard``  INT2 history, Walsh–Hadamard rotation (QuaRot-style), clips 0.96/0.92
``oscar``     INT2 history with the artifact's rotations and clips
``quanto``    transformers' own ``QuantizedCache`` (optimum-quanto, 2 bits) at its defaults:
              residual length 128, group 64, no sink
============  ===========================================================================
"""

from __future__ import annotations

from ..errors import InputError
from ..runtime.scheme import KVScheme
from ..spec.defaults import (
    BASELINE_CLIPS,
    DEFAULT_RECENT,
    DEFAULT_SINK,
    check_group_size,
    default_group_size,
)

METHODS = ("bf16", "naive", "hadamard", "oscar", "quanto")


QUANTO_DEFAULTS = {"nbits": 2, "residual_length": 128, "q_group_size": 64}


def parse_methods(text: str | list[str]) -> list[str]:
    items = [m.strip().lower() for m in (text.split(",") if isinstance(text, str) else text) if m.strip()]
    if not items:
        raise InputError("--methods is empty")
    bad = [m for m in items if m not in METHODS]
    if bad:
        raise InputError(f"unknown method(s) {', '.join(bad)}; choose from {', '.join(METHODS)}")
    return list(dict.fromkeys(items))


def build_schemes(methods: list[str], geo, *, artifact=None, group_size: int | None = None, sink: int = DEFAULT_SINK,
                  recent: int = DEFAULT_RECENT, hadamard_clips=BASELINE_CLIPS) -> dict[str, KVScheme]:
    """The :class:`KVScheme` of every simulated method (``quanto`` has none). The group size is
    ``group_size``, else the artifact's, else ``min(128, head_dim)``."""

    if "oscar" in methods and artifact is None:
        raise InputError("method 'oscar' needs an ARTIFACT (or leave it out of --methods)")
    g = group_size or (artifact.group_size if artifact is not None else default_group_size(geo.head_dim))
    check_group_size(geo.head_dim, g)
    out = {}
    for m in methods:
        if m == "bf16":
            out[m] = KVScheme.full_precision(geo.num_layers, sink=sink, recent=recent)
        elif m in ("naive", "hadamard"):
            rot, clips = ("identity", (1.0, 1.0)) if m == "naive" else ("hadamard", tuple(hadamard_clips))
            out[m] = KVScheme.uniform(m, geo.num_layers, geo.num_kv_heads, geo.head_dim, g, rotation=rot,
                                      clips=clips, sink=sink, recent=recent)
        elif m == "oscar":
            out[m] = KVScheme.from_artifact(artifact, group_size=g, sink=sink, recent=recent)
    return out


def bits_of(method: str, scheme: KVScheme | None) -> float:
    """Stored bits per INT2-history element (16 for bf16; quanto: 2 + 32/64 with 16-bit params)."""
    if method == "quanto":
        return 2.0 + 32.0 / QUANTO_DEFAULTS["q_group_size"]
    if scheme is None or not scheme.quantized:
        return 16.0
    return scheme.bits_per_element


def quanto_cache(config):
    """transformers' ``QuantizedCache`` (optimum-quanto backend, 2 bits, its default residual
    length and group size). For models with sliding-window layers, which ``QuantizedCache``
    refuses, every layer is a ``QuantoQuantizedLayer`` keeping all tokens (the mask applies the
    window)."""
    try:
        import optimum.quanto  # noqa: F401
    except ImportError:
        raise InputError("method 'quanto' needs optimum-quanto: pip install 'oscar-calib[quanto]'") from None
    from transformers.cache_utils import Cache, QuantizedCache, QuantoQuantizedLayer

    cfg = config.get_text_config(decoder=True)
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    if all(t == "full_attention" for t in types):
        return QuantizedCache(backend="quanto", config=cfg, nbits=QUANTO_DEFAULTS["nbits"])
    return Cache(layers=[QuantoQuantizedLayer(nbits=QUANTO_DEFAULTS["nbits"]) for _ in types])
