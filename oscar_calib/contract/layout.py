"""The names of the artifact contract, format version 1: files, tensors and metadata keys.

The one place that names what an artifact holds. It imports nothing, so every other module of
the contract (:mod:`.values`, :mod:`.digest`, :mod:`.checks`, :mod:`.artifact`) builds on it
without importing each other in a circle.

Layout of an artifact directory::

    <out>/oscar.safetensors     rotations, clips and eigenvalues (float32)
    <out>/README.md             model card
    <out>/calibration.json      per-layer report, timings, settings
    <out>/verify.json           what ``oscar verify`` measured, and on which content (optional)

and of a zoo (a directory of artifacts): its ``index.json`` (:func:`is_zoo_index`), which
``oscar zoo index`` writes and ``oscar validate`` checks and skips as no artifact.
"""

from __future__ import annotations

import json
from pathlib import Path

WEIGHTS_NAME = "oscar.safetensors"
CARD_NAME = "README.md"
REPORT_NAME = "calibration.json"
# the pictures `oscar eval --record` keeps beside the model card, by the result they draw: perplexity
# against context length (a long-context result) and needle retrieval against context length
CARD_PLOTS = {"long": "eval-context.png", "niah": "eval-niah.png"}
VERIFY_NAME = "verify.json"
PULL_RECORD = ".oscar-pull.json"      # where an artifact came from, written by `oscar pull` (hidden: never pushed)
FORMAT_NAME = "oscar-rotations"
IMPORTED = "imported"                 # objective/composition of an artifact made by ``oscar import``

TENSOR_KINDS = ("k_rotation", "v_rotation", "k_clip", "v_clip", "k_eigenvalues", "v_eigenvalues")
# Optional, additive (toolkit 0.2): one rotation per layer shared by all its KV heads, computed from the
# pooled statistics, for engines that take one rotation per layer (the OSCAR SGLang fork's main). All of
# them or none, for every layer; eigenvalues descending like the per-head ones.
SHARED_KINDS = ("k_layer_rotation", "v_layer_rotation", "k_layer_eigenvalues", "v_layer_eigenvalues")
# Optional, additive: the mean post-RoPE key of every KV head ``[num_kv_heads, head_dim]`` (key centering,
# `oscar calibrate --center-keys`). Every stored key is ``(k − μ) @ R_k``; ``q·μ`` is the same for every key a
# query reads, so softmax is unchanged while the INT2 range of every key group shrinks. On every layer exactly
# when the metadata says ``k_centered = "true"`` (:data:`KEY_CENTERING_METADATA`), on none otherwise.
CENTER_KINDS = ("k_mean",)
# every tensor kind a layer may hold, required then optional
KINDS = TENSOR_KINDS + SHARED_KINDS + CENTER_KINDS
# Optional metadata (toolkit 0.2): the one K and one V clip ratio fitted for the shared rotations
# (an engine that applies one ratio per cache for the whole model).
SHARED_CLIP_METADATA = ("fork_k_clip", "fork_v_clip")
# Optional metadata (toolkit 0.3): the INT2 group size of every layer, comma separated (K and V of a layer
# share it), when a bit budget gave layers different sizes (`oscar calibrate --bit-budget`). ``group_size``
# then holds the closest uniform size within the same budget (what an engine with one size serves).
LAYER_GROUPS_METADATA = "layer_group_sizes"
# Optional metadata (toolkit 0.4): the values' INT2 group size of every layer, comma separated, when keys and
# values use different sizes (`oscar calibrate --bit-budget B --split-kv`). ``layer_group_sizes`` (or, without
# it, ``group_size``) then holds the keys' sizes. A reader that predates it stores the values at the keys'
# sizes: a different scheme from the one calibrated (in either direction: the budget does not order K and V).
LAYER_V_GROUPS_METADATA = "layer_v_group_sizes"
# Optional metadata (toolkit 0.4): the gain of the logit-noise correction (`oscar calibrate --logit-correction`),
# a number in [0, 4]; absent means 0 (off). A reader that predates it serves the cache without the correction.
LOGIT_CORRECTION_METADATA = "logit_correction"
# Optional metadata (toolkit 0.5): where the text config came from when the model's config wraps it (a
# multimodal model whose language model was calibrated), ``<wrapper model_type>.<attribute>``, e.g.
# ``gemma3.text_config``; ``model_type`` is then the text model's. Absent: the model's config is the text config.
TEXT_CONFIG_METADATA = "text_config"
# Optional metadata: the model's decoder-layer index of every artifact layer, comma separated and increasing, when
# they are not 0..num_layers-1 (a hybrid model, whose linear-attention or state-space layers keep no KV cache and
# have no artifact layer: Qwen3.5's "3,7,11,..."). Absent: artifact layer i is decoder layer i. A reader that
# predates it would put the rotations on the model's first layers: engines that cannot map it refuse.
LAYER_IDS_METADATA = "layer_ids"
# Optional metadata: every layer's head_dim and KV-head count, comma separated, when layers differ (Gemma 4: sliding
# layers 256, global layers 512 with fewer KV heads); ``head_dim`` / ``num_kv_heads`` then hold layer 0's. Layer i's
# tensors take its own shapes. A reader that predates them refuses the file (its shapes disagree with the metadata).
LAYER_HEAD_DIMS_METADATA = "layer_head_dims"
LAYER_KV_HEADS_METADATA = "layer_kv_heads"
# Optional metadata: "true" when the value rotation is folded into a checkpoint's v_proj/o_proj (`oscar
# fold-weights` marks the artifact copy it writes beside the checkpoint); absent or "false" otherwise.
V_FOLDED_METADATA = "v_folded"
# Optional metadata: "true" when every layer stores its keys centered (``layers.{i}.k_mean``, :data:`CENTER_KINDS`);
# absent otherwise. A reader that predates it stores the keys uncentered: the rotations and clips then meet keys
# whose range they were not fitted for (still a valid cache, a less accurate one).
KEY_CENTERING_METADATA = "k_centered"
# Written with "k_centered" (optional to read: absent means "centered"): what the calibration fitted the key
# rotations, clips and group sizes on, one of ``defaults.CENTER_FITS`` ("centered" keys, or "raw" ones exactly
# as without centering, the mean key alone added). No reader needs it to serve the file; it says what an
# engine that does not subtract ``k_mean`` serves.
KEY_CENTER_FIT_METADATA = "k_center_fit"
# Written by every writer of the toolkit (optional to read: older files lack it): the content digest,
# sha256 over the metadata (this key left out) and every tensor's name, dtype, shape and bytes
# (:mod:`.digest`). A reader refuses a file whose content no longer matches it.
DIGEST_KEY = "content_sha256"

REQUIRED_METADATA = (
    "format", "format_version", "model_id", "model_fingerprint", "num_layers",
    "num_attention_heads", "num_kv_heads", "head_dim", "group_size", "bits", "sink_tokens",
    "recent_tokens", "k_objective", "v_objective", "composition", "granularity", "calibration",
    "toolkit_version",
)
INT_METADATA = ("format_version", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim",
                "group_size", "bits", "sink_tokens", "recent_tokens")
GEOMETRY_KEYS = ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim")


def tensor_name(layer: int, kind: str) -> str:
    if kind not in KINDS:
        raise KeyError(kind)
    return f"layers.{layer}.{kind}"


def tensor_shape(kind: str, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    if kind in ("k_layer_rotation", "v_layer_rotation"):
        return (head_dim, head_dim)
    if kind in ("k_layer_eigenvalues", "v_layer_eigenvalues"):
        return (head_dim,)
    if kind.endswith("rotation"):
        return (num_kv_heads, head_dim, head_dim)
    if kind.endswith("clip"):
        return (num_kv_heads,)
    return (num_kv_heads, head_dim)          # eigenvalues, k_mean


def dtype_name(t) -> str:
    """``float32`` for a torch or numpy float32 tensor (and so on): the dtype without its library."""
    return str(t.dtype).removeprefix("torch.")
# Optional metadata (toolkit 0.3): where the model came from, a JSON object (``model_id`` stays the
# model's name): ``kind`` (alias | local | gguf | hub); ``alias`` (a pip-shipped model's name) or
# ``path`` (the absolute directory or .gguf file a local model was read from); ``hub_id`` when
# known. Tools load the model from it (``model.source.model_for_artifact``); the card shows it.
MODEL_SOURCE_METADATA = "model_source"
MODEL_SOURCE_KINDS = ("alias", "local", "gguf", "hub")
MODEL_SOURCE_FIELDS = ("kind", "alias", "path", "hub_id")

# A zoo's index of its artifacts (`oscar zoo index`, oscar_calib.tools.zoo), committed beside them.
ZOO_INDEX_NAME = "index.json"
ZOO_INDEX_FORMAT = "oscar-zoo-index"
ZOO_INDEX_VERSION = 1


def is_zoo_index(path: Path) -> bool:
    """Whether ``path`` is a zoo's ``index.json`` (its ``format`` says so)."""
    path = Path(path)
    if path.name != ZOO_INDEX_NAME:
        return False
    try:
        return json.loads(path.read_text()).get("format") == ZOO_INDEX_FORMAT
    except (OSError, ValueError, AttributeError):
        return False
