"""The evaluation methods: which KV scheme each one reads through, and its stored bits.

==============  =========================================================================
method          what the KV cache holds
==============  =========================================================================
``bf16``        every K/V row in BF16 (the reference)
``naive``       INT2 history, no rotation, no clip
``hadamard``    INT2 history, Walsh–Hadamard rotation (QuaRot-style), clips 0.96/0.92
``oscar``       INT2 history with the artifact's rotations and clips
``fork``        what the OSCAR SGLang fork's main serves for the artifact (``oscar export``'s
                settings): the layer's shared rotation held in BF16, ONE K and ONE V clip ratio
                for the whole model (``fork_k_clip``/``fork_v_clip``), the artifact's group
                size, sink and recent window, float32 scale and zero (``2 + 64/G`` bits)
``fork-lloyd``  ``fork`` with the fork's Lloyd-Max buckets (``SGLANG_LLOYD_MAX=1``; needs group
                size = head_dim); not in the default set
``vllm``        what vLLM's OSCAR backend (pull request #46774) serves for the artifact
                (``oscar export --target vllm``): the layer's shared rotation in float32, ONE K
                and ONE V clip ratio, one INT2 group per head vector with fp16 scale and
                minimum (``2 + 32/head_dim`` bits), no high-precision window, the first and
                last two layers in BF16 (the revision its loader was read at); ppl only
``llamacpp``    what OSCAR's llama.cpp branch serves (``--target llamacpp``): the shared
                rotation in float32, ``q2_0`` (mean-subtracted 128-value chunks of the whole
                K/V row, 4 Lloyd-Max levels per 32 values, 3 bits), ONE clip ratio (K's) for
                K and V, the artifact's sink and recent window in F16, the query as ``q8_0``
                against the ``q2_0`` keys; ppl only
``quanto``      transformers' own ``QuantizedCache`` (optimum-quanto, 2 bits) at its defaults:
                residual length 128, group 64, no sink
==============  =========================================================================

``vllm`` and ``llamacpp`` are simulations of those engines' arithmetic
(:mod:`oscar_calib.numerics.engines`, :func:`~oscar_calib.runtime.simulate.vllm_rows`,
:func:`~oscar_calib.runtime.simulate.llamacpp_rows`), per query position as for ``fork``; what
each engine's scheme costs against ``oscar`` is what the zoo cards show.

``fork`` is the fork's arithmetic only in the perplexity simulation
(:func:`~oscar_calib.runtime.simulate.fork_rows`, which says what it leaves out: the decode-time
recent window sliding between R and R+7 tokens, the decode flush's bisection clip, full-precision
attention inside a prefill chunk). NIAH runs through oscar's real INT2 cache, so there ``fork`` is
the fork's rotations, clips, group size and windows stored with oscar's fp16 scale/offset
(``2 + 32/G`` bits), and ``fork-lloyd`` is refused.
"""

from __future__ import annotations

from ..contract.defaults import (
    BASELINE_CLIPS,
    DEFAULT_RECENT,
    DEFAULT_SINK,
    check_group_size,
    default_group_size,
)
from ..errors import InputError
from ..runtime.scheme import KVScheme, fork_unavailable

METHODS = ("bf16", "naive", "hadamard", "oscar", "fork", "fork-lloyd", "vllm", "llamacpp", "quanto")
# What `oscar eval` runs unless --methods names others. Each method costs one forward pass per
# held-out sequence (the artifact's, with its logit-noise correction, about twice that), so this
# set decides how long a plain `oscar eval` takes. The rest run when named: ``naive`` (no rotation:
# far worse than Hadamard, it shows why rotating matters), ``fork-lloyd``, the other engines'
# schemes, and ``quanto``, which decodes every token one step at a time: minutes on a CPU.
DEFAULT_METHODS = ("bf16", "hadamard", "oscar", "fork")
ENGINE_METHODS = ("vllm", "llamacpp")                    # other engines' schemes (perplexity simulation only)
ARTIFACT_METHODS = ("oscar", "fork", "fork-lloyd", *ENGINE_METHODS)      # need an ARTIFACT
FORK_METHODS = ("fork", "fork-lloyd")


QUANTO_DEFAULTS = {"nbits": 2, "residual_length": 128, "q_group_size": 64}


def parse_methods(text: str | list[str]) -> list[str]:
    items = [m.strip().lower() for m in (text.split(",") if isinstance(text, str) else text) if m.strip()]
    if not items:
        raise InputError("--methods is empty")
    bad = [m for m in items if m not in METHODS]
    if bad:
        raise InputError(f"unknown method(s) {', '.join(bad)}; choose from {', '.join(METHODS)}")
    return list(dict.fromkeys(items))


def resolve_methods(methods, artifact) -> tuple[tuple[str, ...], list[str]]:
    """The methods that run for ``artifact`` (None: no ARTIFACT), and a note per method left out:
    without an artifact the methods that need one (an error when nothing else remains); with the
    default set, ``fork`` when the artifact cannot give it (made before oscar 0.2). A ``fork`` asked
    for by name on such an artifact stays and fails in :func:`build_schemes` with the reason."""
    methods, notes = tuple(methods), []
    if artifact is None and set(methods) & set(ARTIFACT_METHODS):
        if set(methods) <= set(ARTIFACT_METHODS):
            raise InputError(f"method(s) {', '.join(methods)} need an ARTIFACT")
        methods = tuple(m for m in methods if m not in ARTIFACT_METHODS)
    elif artifact is not None and methods == DEFAULT_METHODS:
        why = fork_unavailable(artifact)
        if why:
            methods = tuple(m for m in methods if m != "fork")
            notes.append(f"method 'fork' left out: {why}")
    return methods, notes


def build_schemes(methods: list[str], geo, *, artifact=None, group_size: int | None = None, sink: int = DEFAULT_SINK,
                  recent: int = DEFAULT_RECENT, hadamard_clips=BASELINE_CLIPS,
                  real_cache: bool = False, logit_correction: float | None = None) -> dict[str, KVScheme]:
    """The :class:`KVScheme` of every simulated method (``quanto`` has none). The group size is
    ``group_size``, else the artifact's (``oscar``: its per-layer sizes when it stores them, the
    baselines its uniform ``group_size``), else ``min(128, head_dim)``; ``fork`` methods take the
    artifact's group size, sink and window (what ``oscar export`` serves). ``real_cache``: the
    schemes go into oscar's real cache, so ``fork`` keeps oscar's quantiser and ``fork-lloyd`` is
    refused (module docstring)."""

    for m in methods:
        if m in ARTIFACT_METHODS and artifact is None:
            raise InputError(f"method {m!r} needs an ARTIFACT (or leave it out of --methods)")
    if real_cache and "fork-lloyd" in methods:
        raise InputError("method 'fork-lloyd' runs only in the perplexity simulation (--task ppl): oscar's real INT2 "
                         "cache has no Lloyd-Max buckets")
    engines = [m for m in methods if m in ENGINE_METHODS]
    if real_cache and engines:
        raise InputError(f"method(s) {', '.join(engines)} run only in the perplexity simulation (--task ppl): oscar's "
                         "real INT2 cache stores oscar's own quantiser")
    g = group_size or (artifact.group_size if artifact is not None else default_group_size(min(geo.head_dims)))
    for d in sorted(set(geo.head_dims)):
        check_group_size(d, g)
    out = {}
    for m in methods:
        if m == "bf16":
            out[m] = KVScheme.full_precision(geo.num_layers, sink=sink, recent=recent)
        elif m in ("naive", "hadamard"):
            rot, clips = ("identity", (1.0, 1.0)) if m == "naive" else ("hadamard", tuple(hadamard_clips))
            out[m] = KVScheme.uniform(m, geo.num_layers, geo.kv_heads, geo.head_dims, g, rotation=rot,
                                      clips=clips, sink=sink, recent=recent)
        elif m == "oscar":
            out[m] = KVScheme.from_artifact(artifact, group_size=group_size, sink=sink, recent=recent,
                                            logit_correction=logit_correction)
        elif m in FORK_METHODS:
            out[m] = KVScheme.shared_from_artifact(artifact, name=m, quantizer="oscar" if real_cache else m)
        elif m in ENGINE_METHODS:
            out[m] = KVScheme.engine_from_artifact(artifact, m)
    return out


def engine_settings(schemes: dict[str, KVScheme]) -> dict | None:
    """What the other engines' methods ran with (for the result's settings), or None when none ran."""
    out = {}
    for m, sch in schemes.items():
        if m not in ENGINE_METHODS:
            continue
        ck, cv = (None if c is None else round(float(c[0]), 6) for c in (sch.k_clip[0], sch.v_clip[0]))
        out[m] = {"k_clip": ck, "v_clip": cv, "group_size": sch.group_size, "sink": sch.sink, "recent": sch.recent,
                  "native_layers": list(sch.native_layers), "window_dtype": str(sch.window_dtype).replace("torch.", ""),
                  "bits_per_element": sch.bits_per_element}
    return out or None


def fork_settings(schemes: dict[str, KVScheme], artifact) -> dict | None:
    """What the fork methods ran with (for the result's settings), or None when none ran."""
    forks = [m for m in schemes if m in FORK_METHODS]
    if not forks:
        return None
    sch = schemes[forks[0]]
    k, v = artifact.shared_clips()
    return {"methods": forks, "k_clip": k, "v_clip": v, "group_size": sch.group_size, "sink": sch.sink,
            "recent": sch.recent, "quantizer": {m: schemes[m].quantizer for m in forks},
            "rotations": "one rotation per layer, held in bf16"}


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

    from ..runtime.compat import cache_slots

    cfg = config.get_text_config(decoder=True)
    if any(slot.state is not None for slot in cache_slots(cfg)):
        raise InputError(f"method 'quanto': transformers' QuantizedCache holds no recurrent state, which "
                         f"{cfg.model_type}'s linear-attention or state-space layers keep (leave it out of --methods)")
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    if all(t == "full_attention" for t in types):
        return QuantizedCache(backend="quanto", config=cfg, nbits=QUANTO_DEFAULTS["nbits"])
    return Cache(layers=[QuantoQuantizedLayer(nbits=QUANTO_DEFAULTS["nbits"]) for _ in types])


def method_fields(method: str, sch: KVScheme | None, sink: int, recent: int) -> dict:
    """A perplexity row's description of what ``method`` stored: bits per history element, group
    size, per-layer sizes of a bit budget, the correction's gain, and windows other than ``sink`` /
    ``recent`` (the fork methods take the artifact's)."""
    row = {"bits_per_element": bits_of(method, sch),
           "group_size": QUANTO_DEFAULTS["q_group_size"] if method == "quanto" else (sch.group_size if sch else None)}
    if sch is not None and sch.quantized and not sch.uniform_groups:
        row["layer_group_sizes"] = [list(sch.groups(i)) for i in range(sch.num_layers)]   # a bit budget
    if sch is not None and sch.logit_correction:
        row["logit_correction"] = sch.logit_correction
    if sch is not None and (sch.sink, sch.recent) != (sink, recent):
        row.update(sink=sch.sink, recent=sch.recent)
    return row


def gap_closed(rows: list[dict]) -> None:
    """Set each row's share of the Hadamard → BF16 perplexity gap it closes
    (``gap_closed_vs_hadamard``), where both ran (rows of one length)."""
    by = {r["method"]: r["ppl"] for r in rows}
    for r in rows:
        if "bf16" in by and "hadamard" in by and by["hadamard"] != by["bf16"]:
            r["gap_closed_vs_hadamard"] = (by["hadamard"] - r["ppl"]) / (by["hadamard"] - by["bf16"])


def scheme_settings(schemes: dict, artifact) -> dict:
    """What a perplexity result's settings say about the fork's and other engines' schemes."""
    out = {}
    fork = fork_settings(schemes, artifact)
    if fork:
        out["fork"] = fork
    engines = engine_settings(schemes)
    if engines:
        out["engines"] = engines
    return out
