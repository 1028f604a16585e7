"""The maths of folding: ``v_rotation`` into ``v_proj`` rows and ``o_proj`` columns, in place.

With row vectors (``v = x W_vᵀ + b``) and ``R = v_rotation[h]`` for KV head ``h``:

=====================  ======================================================================
weight                 after folding (math in float64, cast to the weight's dtype)
=====================  ======================================================================
``v_proj`` rows of h   ``W_v,h' = Rᵀ W_v,h``, bias ``b_h' = b_h R``: the projection yields ``v R``
fused ``qkv_proj``     the same on the V rows, which are the last ``num_kv_heads·head_dim`` rows
``o_proj`` columns     for every query head ``j`` reading KV head ``h = j // (Hq/Hkv)``:
                       ``W_o[:, j] ' = W_o[:, j] R``, so ``o_proj(o_rot) = o_proj(o)``, ``o = o_rot Rᵀ``
=====================  ======================================================================

Before any weight changes, the artifact is checked (:func:`check_artifact_matches`: valid by the
validator's rules, calibrated for this model, not folded already) and every layer's layout is
validated (:func:`fold_targets`: plain float ``nn.Linear`` projections of the expected shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...contract.artifact import Artifact, require_compatible, valid_artifact
from ...contract.layout import V_FOLDED_METADATA
from ...errors import ArtifactError, UnsupportedModelError
from ...model.geometry import (
    Geometry,
    attention_modules,
    geometry_of,
    model_fingerprint,
    text_config,
)
from ...model.registry import ArchSpec, arch_for
from ...progress import ProgressFn, counter

CONFIG_KEY = "oscar"
FOLDED_KEY = V_FOLDED_METADATA     # the artifact key and the checkpoint config key



# ----------------------------------------------------------------------------- checks

def refuse_folded_artifact(artifact: Artifact) -> None:
    if artifact.settings.v_folded:
        raise ArtifactError(f"{artifact.path or 'the artifact'}: its value rotation is already folded into a "
                            "checkpoint (v_folded=true); fold the original artifact into the original model")


def require_valid_values(artifact: Artifact) -> None:
    """The validator's checks on an artifact in memory (its settings when it was built, its tensors
    here: :func:`~oscar_calib.contract.artifact.valid_artifact`), raising its first line."""
    valid_artifact(artifact)


def check_artifact_matches(model, artifact: Artifact, *, geometry: Geometry | None = None,
                           fingerprint: str | None = None) -> Geometry:
    """Raise :class:`ArtifactError` unless ``artifact`` is valid, was calibrated for ``model`` and
    still needs folding (neither the artifact nor the model says it is folded); returns the
    model's geometry. ``geometry``/``fingerprint``: the model's, when already known."""
    refuse_folded_artifact(artifact)
    folded_cfg = getattr(text_config(model.config), CONFIG_KEY, None) or getattr(model.config, CONFIG_KEY, None)
    if isinstance(folded_cfg, dict) and folded_cfg.get(FOLDED_KEY):
        sha = str(folded_cfg.get("artifact_fingerprint", "?"))[:12]
        raise ArtifactError("this model's config.json says an OSCAR value rotation is already folded into it "
                            f"(artifact {sha}…); fold into the original model")
    require_valid_values(artifact)
    geo = geometry or geometry_of(model)
    require_compatible(artifact, geo, fingerprint or model_fingerprint(model))
    return geo


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _plain_linear(module, what: str, rows: int | None = None) -> torch.nn.Linear:
    """``module`` as a plain ``nn.Linear`` holding ordinary float tensors, or a clear refusal."""
    if module is None:
        raise UnsupportedModelError(f"{what}: module not found")
    name = type(module).__name__
    if not isinstance(module, torch.nn.Linear) or type(module).forward is not torch.nn.Linear.forward:
        raise UnsupportedModelError(f"{what} is a {name}, not a plain torch.nn.Linear (quantised or custom layer); "
                                    "fold-weights needs a float checkpoint")
    held = [n for n, _ in module.named_parameters(recurse=False)] + [n for n, _ in module.named_buffers(recurse=False)]
    extra = sorted(n for n in held if n not in ("weight", "bias"))
    if extra:
        raise UnsupportedModelError(f"{what} carries {', '.join(extra)} beside its weight (block-quantised weights?); "
                                    "fold-weights needs a float checkpoint")
    for pname in ("weight", "bias"):
        t = getattr(module, pname)
        if t is None:
            continue
        if type(t.data) is not torch.Tensor or t.dtype not in _FLOAT_DTYPES:
            raise UnsupportedModelError(f"{what}.{pname} is {type(t.data).__name__} of dtype {t.dtype}, not a plain "
                                        "float tensor (FP8/INT weights cannot be folded exactly)")
        if t.device.type == "meta":
            raise UnsupportedModelError(f"{what}.{pname} is on the meta device (offloaded weights cannot be folded)")
    w = module.weight
    if w.dim() != 2:
        raise UnsupportedModelError(f"{what}.weight has shape {list(w.shape)}, expected a matrix")
    if rows is not None and w.shape[0] != rows:
        raise UnsupportedModelError(f"{what}.weight has {w.shape[0]} output rows, expected {rows}")
    return module


@dataclass(frozen=True)
class FoldTarget:
    """Where one layer's value rows and output columns live."""

    v: torch.nn.Linear       # v_proj, or the fused qkv projection
    v_offset: int            # first V row inside ``v``'s weight
    o: torch.nn.Linear


def fold_targets(model, geo: Geometry | None = None) -> list[FoldTarget]:
    """Every layer's fold target, validated before anything changes."""
    geo = geo or geometry_of(model)
    spec: ArchSpec = arch_for(geo.model_type, text_config(model.config))
    if not spec.o_proj or not (spec.v_proj or spec.fused_qkv):
        raise UnsupportedModelError(f"{geo.model_type}: the architecture registry names no value/output projection "
                                    "for it, so the value rotation cannot be folded")
    hq = geo.num_attention_heads
    targets = []
    for i, attn in enumerate(attention_modules(model)):
        hkv, d = geo.kv_heads[i], geo.head_dims[i]
        where = f"layer {geo.ids[i]} ({type(attn).__name__})"
        if spec.fused_qkv:
            v = _plain_linear(getattr(attn, spec.fused_qkv, None), f"{where}.{spec.fused_qkv}",
                              rows=(hq + 2 * hkv) * d)
            offset = (hq + hkv) * d
        else:
            v = _plain_linear(getattr(attn, spec.v_proj, None), f"{where}.{spec.v_proj}", rows=hkv * d)
            offset = 0
        o = _plain_linear(getattr(attn, spec.o_proj, None), f"{where}.{spec.o_proj}")
        if o.weight.shape[1] != hq * d:
            raise UnsupportedModelError(f"{where}.{spec.o_proj}.weight has {o.weight.shape[1]} input columns, "
                                        f"expected {hq} heads × {d}")
        targets.append(FoldTarget(v, offset, o))
    return targets


# ----------------------------------------------------------------------------- the fold

def _math_device(t: torch.Tensor) -> torch.device:
    return torch.device("cpu") if t.device.type == "mps" else t.device   # no float64 on MPS


@torch.no_grad()
def fold_layer(target: FoldTarget, rotation: torch.Tensor, num_attention_heads: int) -> None:
    """Fold ``rotation`` [num_kv_heads, d, d] into one layer, in place (float64 math)."""
    hkv, d, _ = rotation.shape
    group = num_attention_heads // hkv
    w = target.v.weight
    dev = _math_device(w)
    r = rotation.to(dev, torch.float64)
    rows = slice(target.v_offset, target.v_offset + hkv * d)
    wv = w[rows].to(dev, torch.float64).reshape(hkv, d, -1)
    w[rows] = torch.einsum("hde,hdk->hek", r, wv).reshape(hkv * d, -1).to(w.device, w.dtype)   # Rᵀ W_h
    if target.v.bias is not None:
        b = target.v.bias
        bv = b[rows].to(dev, torch.float64).reshape(hkv, d)
        b[rows] = torch.einsum("hd,hde->he", bv, r).reshape(-1).to(b.device, b.dtype)           # b_h R
    wo = target.o.weight
    r_q = r.repeat_interleave(group, dim=0)                      # query head j reads KV head j // group
    wo64 = wo.to(dev, torch.float64).reshape(wo.shape[0], num_attention_heads, d)
    wo.copy_(torch.einsum("ojd,jde->oje", wo64, r_q).reshape(wo.shape).to(wo.device, wo.dtype))  # W_o[:, j] R


def fold_v_rotation(model, artifact: Artifact, *, progress: ProgressFn | None = None,
                    checked: Geometry | None = None) -> None:
    """Fold the artifact's ``v_rotation`` into ``model`` in place. Checks the artifact against the
    model (unless ``checked``: the geometry a caller's own check returned) and validates every
    layer's layout before changing any weight."""
    geo = checked or check_artifact_matches(model, artifact)
    targets = fold_targets(model, geo)
    tick = counter(progress, "fold: V rotation", len(targets), "layers")
    for i, (t, layer) in enumerate(zip(targets, artifact.layers)):
        fold_layer(t, layer.v_rotation, geo.num_attention_heads)
        tick(i + 1)
