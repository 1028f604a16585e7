"""``oscar export --target vllm``: an artifact as vLLM's OSCAR backend (pull request #46774,
``--kv-cache-dtype oscar_int2``) loads it.

Read for this module (nothing copied; the pull request moved, so its parts were read at the
revisions the index holds of ``vllm-project/vllm``):

=============================================================  ===============================================
rule                                                           where (revision)
=============================================================  ===============================================
``torch.load`` (``weights_only=False``: any pickle) of a dict  ``oscar/rotation.py: _load_checkpoint`` (40fa486ee)
with ``"layers"`` (entry: a dict with ``"rotation"``, or the
tensor itself), a flat ``{id: tensor}`` dict, or a stacked
``[num_layers, d, d]`` tensor; ids go through ``int()``
the layer id is the GLOBAL decoder index parsed from the       ``oscar/rotation.py: layer_index_from_name``,
layer name (``.layers.<i>.``); a missing id is served as the   ``get_layer_rotation`` (40fa486ee)
identity, silently (one log line); a rotation not
``(head_dim, head_dim)`` raises
one K and one V file for all KV heads: ``[d, d]`` per layer    ``get_layer_rotation`` (40fa486ee)
env ``VLLM_OSCAR_K/V_ROTATION_PATH``, ``VLLM_OSCAR_K/V_CLIP_    ``oscar/config.py: OscarConfig.from_cache_dtype``
RATIO``, ``VLLM_OSCAR_GROUP_SIZE`` (default 128)               (9195dd08f3)
the first and last ``min(2, L // 2)`` layers stay in the       ``oscar/config.py: get_boundary_skip_layers``
model's dtype (none on hybrid models)                          (9195dd08f3)
one INT2 group per head vector ("``group_size >= head_dim``"):  ``triton_oscar_store.py: _store_int2_vec``
``s = max(max-min, 1e-8)/3`` rounded to fp16, zero = the       (5660ce4a99), ``triton_oscar_decode.py``
fp16 minimum, codes ``clamp(int((x - zero)/s + 0.5), 0, 3)``   (5eee9be311)
against the rounded pair; read back as ``q·s + zero``
=============================================================  ===============================================

Later revisions (read in ``justzhanghong/vllm`` at 79b359bec4 / 7a32e90084, which carry the
pull request's files) add BF16 prefix and recent windows (``VLLM_OSCAR_PREFIX_TOKENS`` /
``VLLM_OSCAR_RECENT_TOKENS``, defaults 64 and 256), ``VLLM_OSCAR_ABSORB_V_ROTATION``, a sorted-index
clip inside the store kernel and BF16 scale/zero-point, and restrict a "prototype" to head_dim 128,
group 128 and clips 0.96/0.92. This export writes those variables too, with explicit values. The
revision that clipped with ``torch.quantile`` (interpolated) was not found in any stored revision;
``oscar eval --methods vllm`` uses the sorted-index rule read at 2736c2eada (``oscar_ops.py:
quantize_int2``) and 7a32e90084 (tested against the quantile rule: at most one order statistic apart).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ...contract.defaults import ORTHOGONALITY_TOL
from ...errors import ArtifactError
from ...fsutil import atomic_write_bytes
from ...numerics.engines import boundary_layers
from .base import (
    Checked,
    ExportSettings,
    ExportTarget,
    Geometry,
    Launch,
    ReadRotations,
    Written,
    per_head_note,
    rotation_problem,
    shared_missing,
    shared_rotations,
    sliding_window_note,
    wrong_paths,
)
from .ptfile import identity_payload, load_plain, payload, save_bytes
from .uniform import serving_clips

K_FILE = "k_rotation.pt"
V_FILE = "v_rotation.pt"


def parse_checkpoint(obj) -> dict[int, object]:
    """vLLM's reading of a rotation checkpoint: ``{layer id: rotation}`` (module docstring); raises
    :class:`ArtifactError` where vLLM raises."""
    out = {}
    if isinstance(obj, dict) and "layers" in obj and isinstance(obj["layers"], dict):
        items = [(k, e["rotation"] if isinstance(e, dict) and "rotation" in e else e) for k, e in obj["layers"].items()]
    elif isinstance(obj, dict) and "layers" not in obj:
        items = list(obj.items())
    elif isinstance(obj, torch.Tensor) and obj.dim() == 3:
        return {i: obj[i] for i in range(obj.shape[0])}
    else:
        raise ArtifactError(f"holds {type(obj).__name__}: vLLM needs a dict with 'layers', a flat {{layer id: "
                            "tensor}} dict, or a stacked [num_layers, d, d] tensor")
    for k, r in items:
        try:
            out[int(k)] = r
        except (TypeError, ValueError):
            raise ArtifactError(f"layer id {k!r} is not an integer (vLLM calls int() on it)") from None
    return out


def vllm_load_problems(path: Path, geo: Geometry) -> list[str]:
    """Would vLLM load ``path`` as the rotations of this model, with every layer rotated? Its rules
    (module docstring) plus what serving needs (finite, orthogonal to 1e-5, every layer present:
    vLLM would silently serve a missing one unrotated)."""
    try:
        obj, _ = load_plain(path)
        table = parse_checkpoint(obj)
    except ArtifactError as e:
        return [f"{Path(path).name}: {e}"]
    problems = []
    missing = [i for i in geo.ids if i not in table]
    if missing:
        problems.append(f"{Path(path).name}: no rotation for layer(s) {missing[:8]}: vLLM would silently serve them "
                        "with the identity")
    for i in geo.ids:
        if i in table:
            p = rotation_problem(table[i], f"{Path(path).name}: layer {i} rotation", (geo.head_dim, geo.head_dim),
                                 ORTHOGONALITY_TOL)
            if p:
                problems.append(p)
    return problems


class VLLMTarget(ExportTarget):
    name = "vllm"
    engine = "vLLM"
    summary = "vLLM with its pull request #46774 (--kv-cache-dtype oscar_int2): [d, d] per global layer id"
    reads = "K.pt V.pt ([d, d] per global layer id; a missing layer is the identity, as vLLM serves it)"
    checked = Checked(
        "vllm-project/vllm (PR #46774)", "40fa486ee, 9195dd08f3, 5660ce4a99, 5eee9be311",
        ("vllm/model_executor/layers/quantization/oscar/rotation.py: _load_checkpoint, get_layer_rotation",
         "vllm/model_executor/layers/quantization/oscar/config.py: OscarConfig.from_cache_dtype, "
         "get_boundary_skip_layers",
         "vllm/v1/attention/ops/triton_oscar_store.py: _store_int2_vec",
         "vllm/v1/attention/ops/triton_oscar_decode.py: _oscar_decode_stage1"),
        status="partial",
        note="the PR moved: loader, config and kernels were read at different PR revisions; later revisions "
             "(justzhanghong/vllm 79b359bec4) add BF16 windows and restrict head_dim to 128; the torch.quantile "
             "clip revision was not found")

    # one [D, D] rotation per GLOBAL layer id (a hybrid model's attention layers keep theirs); one scale/zero pair
    # per head vector (group = head_dim) in every layer; no high-precision window at the revision read (its first
    # and last two layers stay native instead, none on a hybrid model)
    serves = frozenset({"layer_ids"})

    def feature_wording(self, name: str, art, s: ExportSettings) -> str | None:
        st = art.settings
        if name == "per_head_rotations":
            return per_head_note(art, self.engine, "vllm")
        if name == "layer_group_sizes":
            group = max(st.head_dim, s.group_size or st.head_dim)
            return (f"vLLM stores one scale/zero pair per head vector: group {group} where the artifact was calibrated "
                    f"with groups of {min(st.k_groups + st.v_groups)}–{max(st.k_groups + st.v_groups)} "
                    "(`oscar eval --methods vllm` measures it)")
        if name == "windows":
            return (f"vLLM at the revision read keeps no BF16 window (VLLM_OSCAR_PREFIX_TOKENS/RECENT_TOKENS, written "
                    f"as {st.sink_tokens}/{st.recent_tokens}, are read by later revisions only); its first and last "
                    "two layers stay in the model's dtype instead")
        return None

    def refusals(self, art, s: ExportSettings) -> list[str]:
        d, out = art.head_dim, []
        sliding = sliding_window_note(art)
        if sliding:
            out.append(f"{sliding}, and vLLM's OSCAR backend ignores sliding_window (OscarAttentionImpl.__init__ at "
                       "2736c2eada takes and drops it), so those layers would attend to the whole context")
        missing = shared_missing(art)
        if missing:
            out.append(missing)
        if s.group_size is not None and s.group_size < d:
            out.append(f"--group-size {s.group_size}: vLLM's store kernel keeps one scale/zero pair per head vector "
                       f"(group_size >= head_dim = {d})")
        if d % 4:
            out.append(f"head_dim {d} is not a multiple of 4 (vLLM packs four INT2 codes per byte)")
        return out

    def write(self, art, tmp: Path, final: Path, s: ExportSettings) -> Written:
        md, st, d = art.metadata, art.settings, art.head_dim
        folded = st.v_folded if s.folded is None else s.folded
        k_rots, k_eigs = shared_rotations(art, "k", self.engine)
        ids = st.layer_ids                 # vLLM numbers layers globally (layer_index_from_name): a hybrid's own ids
        atomic_write_bytes(tmp / K_FILE, save_bytes(payload(k_rots, k_eigs, objective="vllm", layer_ids=ids)))
        v_obj = identity_payload(art.num_layers, d, ids) if folded else \
            payload(*shared_rotations(art, "v", self.engine), objective="vllm", layer_ids=ids)
        atomic_write_bytes(tmp / V_FILE, save_bytes(v_obj))
        k_clip, v_clip, source = serving_clips(art, s.clip)
        sink = st.sink_tokens if s.sink is None else s.sink
        recent = st.recent_tokens if s.recent is None else s.recent
        group = max(d, s.group_size or d)
        model = s.model_path or md.get("model_id", "")
        env = {"VLLM_OSCAR_K_ROTATION_PATH": str(final / K_FILE), "VLLM_OSCAR_V_ROTATION_PATH": str(final / V_FILE),
               "VLLM_OSCAR_K_CLIP_RATIO": f"{k_clip:g}", "VLLM_OSCAR_V_CLIP_RATIO": f"{v_clip:g}",
               "VLLM_OSCAR_GROUP_SIZE": str(group), "VLLM_OSCAR_PREFIX_TOKENS": str(sink),
               "VLLM_OSCAR_RECENT_TOKENS": str(recent), "VLLM_OSCAR_ABSORB_V_ROTATION": "0"}
        native = [st.layer_ids[i] for i in boundary_layers(art.num_layers, hybrid=st.hybrid)]
        warnings = []
        if st.uniform_groups and st.group_size < group:      # per-layer sizes: the dropped setting's line says it
            warnings.append(f"vLLM stores one scale/zero pair per head vector: group {group} where the artifact was "
                            f"calibrated with groups of {st.group_size} (`oscar eval --methods vllm` measures it)")
        notes = [f"vLLM keeps layers {native} in the model's dtype (get_boundary_skip_layers, revision 9195dd08f3); "
                 "VLLM_OSCAR_PREFIX_TOKENS/RECENT_TOKENS/ABSORB_V_ROTATION are read by later revisions only",
                 "V rotation: " + ("identity (V already folded into the checkpoint by oscar fold-weights)" if folded
                                   else "applied online (stored as V @ R_v, output mapped back with R_vᵀ)")]
        launch = Launch(env, ["vllm", "serve", model, "--kv-cache-dtype", "oscar_int2"], notes)
        settings = {"k_clip": k_clip, "v_clip": v_clip, "clip_source": source, "group_size": group, "sink": sink,
                    "recent": recent, "native_layers": native, "v_identity": folded, "model_path": model}
        return Written([K_FILE, V_FILE], launch, {"VLLM_OSCAR_K_ROTATION_PATH": K_FILE,
                                                  "VLLM_OSCAR_V_ROTATION_PATH": V_FILE}, settings, warnings)

    def load_problems(self, out: Path, geo: Geometry) -> list[str]:
        return vllm_load_problems(Path(out) / K_FILE, geo) + vllm_load_problems(Path(out) / V_FILE, geo)

    def read(self, paths: list[Path], geo: Geometry) -> tuple[ReadRotations, ReadRotations]:
        if len(paths) != 2:
            wrong_paths(self, paths, "a K file and a V file")
        return tuple(read_vllm_file(Path(p), geo) for p in paths)


def read_vllm_file(path: Path, geo: Geometry) -> ReadRotations:
    """The rotations vLLM serves from ``path`` for this model: a missing layer is the identity (as
    vLLM serves it, recorded); a wrong shape or a non-orthogonal rotation is an error."""
    obj, raw = load_plain(path)
    try:
        table = parse_checkpoint(obj)
    except ArtifactError as e:
        raise ArtifactError(f"{path}: {e}") from None
    d, rots, missing = geo.head_dim, [], []
    for i in geo.ids:
        if i not in table:
            missing.append(i)
            rots.append(torch.eye(d).unsqueeze(0))
            continue
        p = rotation_problem(table[i], f"{path}: layer {i} rotation", (d, d), ORTHOGONALITY_TOL)
        if p:
            raise ArtifactError(p)
        rots.append(table[i].to(torch.float32).unsqueeze(0))
    extra = sorted(set(table) - set(geo.ids))
    notes = [f"no rotation for layer(s) {missing[:8]}: imported as the identity, as vLLM serves them"] if missing else []
    if extra:
        notes.append(f"layer(s) {extra[:8]} ignored (not among the model's layers)")
    return ReadRotations(path.name, "vllm", rots, hashlib.sha256(raw).hexdigest(), notes=notes,
                         source_dtype="+".join(sorted({str(r.dtype).replace('torch.', '') for r in table.values()
                                                       if isinstance(r, torch.Tensor)})) or "float32")


TARGET = VLLMTarget()
