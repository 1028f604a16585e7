"""``oscar export`` / ``oscar import``: the OSCAR SGLang fork's rotation files.

The fork (and the upstream RotationZoo) reads one pickle for keys and one for values::

    {"format_version": 1, "layers": {layer_id: {"rotation": fp32[d, d],      "eigenvalues": fp32[d]}}}
    {"format_version": 2, "layers": {layer_id: {"rotation": fp32[h, d, d],   "eigenvalues": fp32[h, d]}}}

``layer_id`` is the 0-based decoder layer (an ``int``); version 1 holds one rotation per layer,
version 2 one per KV head (``h`` = num_kv_heads). Rotations follow oscar's convention (a rotated
row is ``x @ R``).

Export writes into ``--out``:

==================  ============================================================================
file                content
==================  ============================================================================
``k_rotations.pt``  key/query rotations (format_version 1 when the artifact's granularity is
                    ``layer``, else 2)
``v_rotations.pt``  value rotations, same format
``clips.json``      fitted clip ratios per layer and KV head, and the means used in serve.env
``serve.env``       ``KEY=value`` lines for serving: rotation file paths, K/V clip ratios (the
                    fork applies one ratio per cache: the mean of the fitted ratios), sink and
                    recent token counts, group size, bits, whether V is folded into the weights
==================  ============================================================================

Export refuses an artifact whose head_dim is not a power of two (the fork's Hadamard kernels
need one) and any artifact that fails ``oscar validate``.

Import turns such a pair back into a format-v1 artifact for ``--model``. Pickles are only ever
opened with ``torch.load(weights_only=True)``, and the result must be a plain dict of tensors and
numbers (nested dicts allowed); anything else is refused with one line. Choices made for what the
files do not carry:

* clips: fixed, ``0.96`` for K and ``0.92`` for V (the reference's globals) unless ``--clip``;
* eigenvalues: taken from the file when present (sorted descending, since the contract requires
  that order; they only describe the spectrum), otherwise zeros; ``calibration.json`` records
  which;
* ``composition``, ``k_objective``, ``v_objective``: ``"imported"``; granularity ``layer`` when
  both files are format_version 1, else ``head`` (a version-1 rotation is repeated per KV head);
* fingerprint, model_id and geometry: from the model (loaded with
  :func:`oscar_calib.model.load.load_model`); group size ``min(128, head_dim)``, sink 64, recent 256
  unless given.

Both commands build their output in a temporary directory beside ``--out`` and move it into place
only when complete, so an error leaves nothing half-written.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import FORMAT_VERSION, __version__
from ..errors import ArtifactError, InputError, OutputExistsError
from ..fsutil import atomic_write_bytes, staged_dir
from ..spec.artifact import (
    FORMAT_NAME,
    WEIGHTS_NAME,
    Artifact,
    LayerRotations,
    load_artifact,
    write_artifact_files,
)
from ..spec.defaults import BASELINE_CLIPS, ORTHOGONALITY_TOL, is_power_of_two
from .validate import IMPORTED, require_valid

K_FILE = "k_rotations.pt"
V_FILE = "v_rotations.pt"
ENV_FILE = "serve.env"
CLIPS_FILE = "clips.json"
SGLANG_VERSIONS = (1, 2)


# ----------------------------------------------------------------------------- staging


# ----------------------------------------------------------------------------- export

@dataclass
class ExportResult:
    out: Path
    format_version: int
    files: list[str]
    k_clip: float
    v_clip: float

    def to_dict(self) -> dict:
        return {"out": str(self.out), "format": "sglang", "format_version": self.format_version,
                "files": [str(self.out / f) for f in self.files], "k_clip": self.k_clip, "v_clip": self.v_clip}


def sglang_payload(artifact: Artifact, which: str) -> dict:
    """The fork's dict for ``which`` = ``"k"`` or ``"v"``."""
    version = 1 if artifact.metadata.get("granularity") == "layer" else 2
    layers = {}
    for i, layer in enumerate(artifact.layers):
        rot = getattr(layer, f"{which}_rotation").detach().to(torch.float32).contiguous()
        eig = getattr(layer, f"{which}_eigenvalues").detach().to(torch.float32).contiguous()
        if version == 1:
            rot, eig = rot[0].clone(), eig[0].clone()
        layers[i] = {"rotation": rot, "eigenvalues": eig}
    return {"format_version": version, "layers": layers}


def export_sglang(artifact_path: Path, out: Path, *, overwrite: bool = False) -> ExportResult:
    """Write the fork's files for the artifact at ``artifact_path`` into ``out``."""
    report = require_valid(artifact_path)
    head_dim = int(report.metadata["head_dim"])
    if not is_power_of_two(head_dim):
        raise ArtifactError(f"{artifact_path}: head_dim {head_dim} is not a power of two; the OSCAR SGLang "
                            "fork's Hadamard kernels need one, so this artifact cannot be exported for it")
    art = load_artifact(artifact_path)
    md = art.metadata
    k_payload, v_payload = sglang_payload(art, "k"), sglang_payload(art, "v")
    k_clips = [layer.k_clip.tolist() for layer in art.layers]
    v_clips = [layer.v_clip.tolist() for layer in art.layers]
    k_mean = round(sum(map(sum, k_clips)) / sum(map(len, k_clips)), 4)
    v_mean = round(sum(map(sum, v_clips)) / sum(map(len, v_clips)), 4)
    out = Path(out)
    with staged_dir(out, overwrite=overwrite, merge=True) as tmp:
        for name, payload in ((K_FILE, k_payload), (V_FILE, v_payload)):
            buf = io.BytesIO()
            torch.save(payload, buf)
            atomic_write_bytes(tmp / name, buf.getvalue())
        clips = {"k": k_clips, "v": v_clips, "k_mean": k_mean, "v_mean": v_mean,
                 "note": "per layer, per KV head; serve.env carries the means (one ratio per cache)"}
        (tmp / CLIPS_FILE).write_text(json.dumps(clips, indent=2) + "\n")
        (tmp / ENV_FILE).write_text(serve_env(md, out.resolve(), k_payload["format_version"], k_mean, v_mean,
                                              source=Path(artifact_path)))
    return ExportResult(out, k_payload["format_version"], [K_FILE, V_FILE, CLIPS_FILE, ENV_FILE], k_mean, v_mean)


def serve_env(md: dict[str, str], out: Path, version: int, k_clip: float, v_clip: float, *, source: Path) -> str:
    v_folded = md.get("v_folded", "false") == "true"
    lines = [
        f"# OSCAR serving settings, written by `oscar export --format sglang` (oscar {__version__})",
        f"# artifact: {source}  model: {md.get('model_id')}  fingerprint: {md.get('model_fingerprint')}",
        "# Load with `set -a; . serve.env; set +a` before starting the OSCAR SGLang fork.",
        f"OSCAR_K_ROTATIONS={out / K_FILE}",
        f"OSCAR_V_ROTATIONS={out / V_FILE}",
        f"OSCAR_ROTATION_FORMAT_VERSION={version}",
        f"OSCAR_GRANULARITY={'layer' if version == 1 else 'head'}",
        "# clip ratio applied to every rotated row before quantising",
        "# (the mean of the fitted per-layer, per-head ratios; clips.json has them all)",
        f"OSCAR_K_CLIP={k_clip}",
        f"OSCAR_V_CLIP={v_clip}",
        f"OSCAR_KV_BITS={md.get('bits', '2')}",
        f"OSCAR_GROUP_SIZE={md.get('group_size')}",
        "# tokens kept in BF16 at the start (attention sink) and the end (recent window) of the cache",
        f"OSCAR_SINK_TOKENS={md.get('sink_tokens')}",
        f"OSCAR_RECENT_TOKENS={md.get('recent_tokens')}",
        "# 1: the V rotation is already folded into v_proj/o_proj (oscar fold-weights): serve the folded",
        "# checkpoint and do not rotate V online. 0: rotate V online with v_rotations.pt.",
        f"OSCAR_V_FOLDED={1 if v_folded else 0}",
        f"OSCAR_HEAD_DIM={md.get('head_dim')}",
        f"OSCAR_NUM_KV_HEADS={md.get('num_kv_heads')}",
        f"OSCAR_NUM_LAYERS={md.get('num_layers')}",
    ]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- import

@dataclass
class RotationFile:
    """One parsed fork file: ``rotations[i]`` is [h, d, d] (version 1 rotations have h = 1)."""

    path: Path
    format_version: int
    rotations: list[torch.Tensor]
    eigenvalues: list[torch.Tensor | None]
    sha256: str


def _load_reason(e: Exception) -> str:
    """One short line from torch.load's (long, multi-line, ANSI-coloured) refusal."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    m = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if m:
        return f"it pickles the Python object {m.group(1)}"
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")[:120]
    if isinstance(e, pickle.UnpicklingError):
        return f"unpickling refused: {first}"
    return f"not a readable torch.save file: {type(e).__name__}: {first}"


def _check_plain(obj, where: str = "") -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise ArtifactError(f"key {k!r} at {where or 'top level'} is not a string or an integer")
            _check_plain(v, f"{where}[{k!r}]")
    elif obj is not None and not isinstance(obj, (torch.Tensor, int, float, str, bool)):
        raise ArtifactError(f"{where or 'top level'} holds a {type(obj).__name__}; expected a plain dict of "
                            "tensors and numbers")


def load_rotation_file(path: Path, *, num_layers: int, num_kv_heads: int, head_dim: int) -> RotationFile:
    """Read and check one fork file against the model's geometry; one clear error when wrong."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    raw = path.read_bytes()
    try:
        obj = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpickling raises many types; all mean "refused"
        raise ArtifactError(f"{path}: not a plain tensor dict that torch.load(weights_only=True) accepts "
                            f"({_load_reason(e)}); oscar never unpickles anything else") from None
    try:
        if not isinstance(obj, dict):
            raise ArtifactError(f"holds a {type(obj).__name__}, expected a dict with 'format_version' and 'layers'")
        _check_plain(obj)
        version = obj.get("format_version")
        if version not in SGLANG_VERSIONS or isinstance(version, bool):
            raise ArtifactError(f"unsupported format_version {version!r} (expected 1 or 2)")
        layers = obj.get("layers")
        if not isinstance(layers, dict) or not layers:
            raise ArtifactError("'layers' is missing or empty")
        ids = {}
        for key, entry in layers.items():
            if isinstance(key, str) and not key.isdigit():
                raise ArtifactError(f"layer id {key!r} is not an integer")
            ids[int(key)] = entry
        if sorted(ids) != list(range(num_layers)):
            raise ArtifactError(f"has layers {_span(sorted(ids))}, the model has layers 0..{num_layers - 1}")
        rots, eigs = [], []
        want_rot = (head_dim, head_dim) if version == 1 else (num_kv_heads, head_dim, head_dim)
        for i in range(num_layers):
            entry = ids[i]
            if not isinstance(entry, dict) or not isinstance(entry.get("rotation"), torch.Tensor):
                raise ArtifactError(f"layer {i} has no 'rotation' tensor")
            r = entry["rotation"]
            if tuple(r.shape) != want_rot:
                raise ArtifactError(f"layer {i} rotation has shape {list(r.shape)}, expected {list(want_rot)} "
                                    f"(format_version {version}, model head_dim {head_dim}, {num_kv_heads} KV heads)")
            if not r.is_floating_point() or not torch.isfinite(r).all():
                raise ArtifactError(f"layer {i} rotation is not a finite floating-point tensor")
            r = r.to(torch.float32).reshape(-1, head_dim, head_dim)
            r64 = r.to(torch.float64)
            err = float((r64 @ r64.transpose(-1, -2) - torch.eye(head_dim, dtype=torch.float64)).abs().max())
            if err >= ORTHOGONALITY_TOL:
                raise ArtifactError(f"layer {i} rotation is not orthogonal (‖RRᵀ − I‖∞ = {err:.2e})")
            e = entry.get("eigenvalues")
            if e is not None:
                if not isinstance(e, torch.Tensor) or not e.is_floating_point():
                    raise ArtifactError(f"layer {i} 'eigenvalues' is not a floating-point tensor")
                if tuple(e.shape) not in ((head_dim,), (r.shape[0], head_dim)):
                    raise ArtifactError(f"layer {i} eigenvalues have shape {list(e.shape)}, expected "
                                        f"[{head_dim}] or [{r.shape[0]}, {head_dim}]")
                e = e.to(torch.float32).reshape(-1, head_dim)
            rots.append(r)
            eigs.append(e)
    except ArtifactError as e:
        raise ArtifactError(f"{path}: {e}") from None
    return RotationFile(path, int(version), rots, eigs, hashlib.sha256(raw).hexdigest())


def _span(ids: list[int]) -> str:
    if not ids:
        return "none"
    if ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}..{ids[-1]} ({len(ids)})"
    return ", ".join(map(str, ids[:8]))


def _expand(f: RotationFile, i: int, h: int, d: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    r = f.rotations[i].expand(h, d, d).clone()
    e = f.eigenvalues[i]
    if e is None:
        return r, torch.zeros(h, d), "zeros"
    return r, e.expand(h, d).sort(dim=-1, descending=True).values.contiguous(), "file"


@dataclass
class ImportResult:
    out: Path
    artifact: Artifact
    report: dict

    def to_dict(self) -> dict:
        return {"out": str(self.out), "model_id": self.artifact.metadata["model_id"],
                "granularity": self.artifact.metadata["granularity"], "num_layers": self.artifact.num_layers,
                "imported": self.report["imported"]}


def import_sglang(k_path: Path, v_path: Path, model, out: Path, *,
                  clip: tuple[float | None, float | None] = (None, None),
                  group_size: int | None = None, sink_tokens: int = 64, recent_tokens: int = 256,
                  overwrite: bool = False, trust_remote_code: bool = False) -> ImportResult:
    """Build a format-v1 artifact from the fork's K and V files for ``model`` (a MODEL spec,
    or a :class:`~oscar_calib.model.load.LoadedModel` from :func:`~oscar_calib.model.load.load_model`)."""
    from ..model.load import load_model
    from ..spec.defaults import check_group_size, default_group_size

    k_clip = BASELINE_CLIPS[0] if clip[0] is None else float(clip[0])
    v_clip = BASELINE_CLIPS[1] if clip[1] is None else float(clip[1])
    for name, c in (("k", k_clip), ("v", v_clip)):
        if not 0 < c <= 1:
            raise InputError(f"--clip: {name}={c} is outside (0, 1]")
    if sink_tokens < 0 or recent_tokens < 0:
        raise InputError("--sink and --recent must be non-negative")
    out = Path(out)
    if out.is_dir() and (out / WEIGHTS_NAME).exists() and not overwrite:
        raise OutputExistsError(f"{out} already holds an artifact; pass --overwrite to replace it")
    lm = load_model(model, device="cpu", trust_remote_code=trust_remote_code) if isinstance(model, str) else model
    source, geo = lm.source, lm.geometry
    n, h, d = geo.num_layers, geo.num_kv_heads, geo.head_dim
    group_size = group_size or default_group_size(d)
    check_group_size(d, group_size)
    kf = load_rotation_file(k_path, num_layers=n, num_kv_heads=h, head_dim=d)
    vf = load_rotation_file(v_path, num_layers=n, num_kv_heads=h, head_dim=d)
    granularity = "layer" if kf.format_version == 1 and vf.format_version == 1 else "head"
    layers, eig_src = [], {"k": set(), "v": set()}
    for i in range(n):
        kr, ke, ks = _expand(kf, i, h, d)
        vr, ve, vs = _expand(vf, i, h, d)
        eig_src["k"].add(ks)
        eig_src["v"].add(vs)
        layers.append(LayerRotations(k_rotation=kr, v_rotation=vr, k_clip=torch.full((h,), k_clip),
                                     v_clip=torch.full((h,), v_clip), k_eigenvalues=ke, v_eigenvalues=ve))
    fingerprint = lm.fingerprint
    imported = {which: {"file": f.path.name, "sha256": f.sha256, "format_version": f.format_version,
                        "eigenvalues": "+".join(sorted(eig_src[which]))}
                for which, f in (("k", kf), ("v", vf))}
    calibration = {"data": IMPORTED, "tokens": 0, "sequences": 0, "seq_len": 0, "seed": 0, "clip": "fixed",
                   "imported": imported}
    metadata = {
        "format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "model_id": source.model_id,
        "model_fingerprint": fingerprint, "num_layers": str(n), "num_attention_heads": str(geo.num_attention_heads),
        "num_kv_heads": str(h), "head_dim": str(d), "group_size": str(group_size), "bits": "2",
        "sink_tokens": str(sink_tokens), "recent_tokens": str(recent_tokens), "k_objective": IMPORTED,
        "v_objective": IMPORTED, "composition": IMPORTED, "granularity": granularity,
        "calibration": json.dumps(calibration, sort_keys=True), "toolkit_version": __version__,
        "model_type": geo.model_type,
    }
    artifact = Artifact(layers=layers, metadata=metadata)
    report = {"format_version": FORMAT_VERSION, "toolkit_version": __version__, "model_id": source.model_id,
              "model_fingerprint": fingerprint, "group_size": group_size, "calibration": calibration,
              "geometry": geo.__dict__ | {"layer_types": list(geo.layer_types)}, "imported": imported,
              "settings": {"k_clip": k_clip, "v_clip": v_clip, "granularity": granularity,
                           "sink_tokens": sink_tokens, "recent_tokens": recent_tokens}}
    with staged_dir(out, overwrite=overwrite, merge=True, last=WEIGHTS_NAME) as tmp:
        write_artifact_files(tmp, artifact, import_card(report), report)
        require_valid(tmp)
    artifact.path = out
    return ImportResult(out, artifact, report)


def import_card(report: dict) -> str:
    g, s, imp = report["geometry"], report["settings"], report["imported"]
    return "\n".join([
        "---", "library_name: oscar", "tags: [kv-cache, quantization, int2, oscar]",
        f"base_model: {report['model_id']}", "---", "",
        f"# OSCAR rotations for {report['model_id']} (imported)", "",
        f"Imported by the `oscar` toolkit {report['toolkit_version']} from OSCAR SGLang-fork rotation files "
        f"(artifact format v{report['format_version']}).", "",
        "| setting | value |", "|---|---|",
        f"| base model | `{report['model_id']}` (fingerprint `{report['model_fingerprint'][:16]}…`) |",
        f"| geometry | {g['num_layers']} layers, {g['num_attention_heads']} query / {g['num_kv_heads']} KV heads, "
        f"head_dim {g['head_dim']} |",
        f"| source | K `{imp['k']['file']}` (v{imp['k']['format_version']}, sha256 `{imp['k']['sha256'][:16]}…`), "
        f"V `{imp['v']['file']}` (v{imp['v']['format_version']}, sha256 `{imp['v']['sha256'][:16]}…`) |",
        f"| granularity | {s['granularity']} |",
        f"| clips | fixed k={s['k_clip']}, v={s['v_clip']} |",
        f"| eigenvalues | K: {imp['k']['eigenvalues']}, V: {imp['v']['eigenvalues']} |",
        f"| quantisation | INT2, group {report['group_size']}, BF16 sink {s['sink_tokens']} + recent "
        f"{s['recent_tokens']} tokens |", "",
        "Quality has not been measured by oscar; run `oscar verify` on this directory.", "",
    ])


__all__ = ["export_sglang", "import_sglang", "load_rotation_file", "sglang_payload", "K_FILE",
           "V_FILE", "ENV_FILE", "CLIPS_FILE"]
