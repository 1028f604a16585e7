"""``oscar import``: rotations read back from any engine's files (:meth:`~.base.ExportTarget.read`)
as a validated format-v1 artifact.

Pickles are opened with ``torch.load(weights_only=True)`` only. Choices for what the files do not
carry:

* clips: fixed, ``0.96`` for K and ``0.92`` for V (the reference's globals) unless ``--clip``; they
  are also recorded as the artifact's global clips (``fork_k_clip``/``fork_v_clip``), so an
  export serves exactly what was imported;
* eigenvalues: from the file when present (sorted descending, the artifact's order; the fork writes
  them ascending and they only describe the spectrum), otherwise zeros; ``calibration.json`` records
  which;
* granularity ``layer`` when both caches hold one rotation per layer (repeated per KV head), else
  ``head``; ``composition`` and objectives ``"imported"``;
* key centering when the K file carries a ``k_mean`` on every layer (the OSCAR fork's newer files):
  the artifact stores it (``[h, d]``, a ``[d]`` one repeated per KV head);
* fingerprint, model_id and geometry: from the model (a :class:`~oscar_calib.model.load.LoadedModel`,
  or any :class:`ModelTarget`, e.g. one built from ``configs/`` geometry when the weights are not at
  hand); group size ``min(128, head_dim)``, sink 64, recent 256 unless given.

The artifact is built in a temporary directory, validated, and only then moved into ``--out``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ... import FORMAT_VERSION, __version__
from ...contract.artifact import (
    Artifact,
    LayerRotations,
    stamp_artifact,
    write_artifact_files,
)
from ...contract.defaults import (
    BASELINE_CLIPS,
    DEFAULT_RECENT,
    DEFAULT_SINK,
    check_clip,
    check_group_size,
    check_window,
    default_group_size,
)
from ...contract.layout import (
    DIGEST_KEY,
    FORMAT_NAME,
    IMPORTED,
    MODEL_SOURCE_METADATA,
    WEIGHTS_NAME,
)
from ...contract.settings import ArtifactSettings
from ...errors import OutputExistsError, UnsupportedModelError
from ...fsutil import staged_dir
from ..validate import require_valid
from .base import Geometry, ReadRotations


@dataclass
class ModelTarget:
    """What an imported artifact records about its model."""

    model_id: str
    model_type: str
    fingerprint: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: list[str] = field(default_factory=list)
    note: str = ""                     # e.g. "fingerprint from configs/qwen3-8b.yaml geometry"
    source: dict | None = None         # where a loaded model came from (ModelSource.record)
    layer_ids: tuple[int, ...] | None = None     # a hybrid model's attention layers (None: 0..num_layers-1)
    mixed_heads: bool = False          # its layers differ in head_dim or KV heads

    @classmethod
    def from_geometry(cls, model_id: str, g, fingerprint: str, **kw) -> "ModelTarget":
        """From a :class:`~oscar_calib.model.geometry.Geometry` (``kw``: ``note``, ``source``)."""
        return cls(model_id, g.model_type, fingerprint, g.num_layers, g.num_attention_heads, g.num_kv_heads,
                   g.head_dim, list(g.layer_types), layer_ids=g.layer_ids, mixed_heads=g.mixed_heads, **kw)

    @classmethod
    def from_loaded(cls, lm) -> "ModelTarget":
        return cls.from_geometry(lm.source.model_id, lm.geometry, lm.fingerprint, source=lm.source.record())

    def geometry(self) -> dict:
        return {"model_type": self.model_type, "num_layers": self.num_layers,
                "num_attention_heads": self.num_attention_heads, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "layer_types": self.layer_types,
                **({"layer_ids": list(self.layer_ids)} if self.layer_ids is not None else {})}


@dataclass
class ImportResult:
    out: Path
    artifact: Artifact
    report: dict

    def to_dict(self) -> dict:
        return {"out": str(self.out), "model_id": self.artifact.metadata["model_id"],
                "granularity": self.artifact.metadata["granularity"], "num_layers": self.artifact.num_layers,
                "imported": self.report["imported"]}


def _eigen(f: ReadRotations, i: int, h: int, d: int) -> tuple[torch.Tensor, str]:
    e = f.eigenvalues[i]
    if e is None:
        return torch.zeros(h, d), "zeros"
    return e.expand(h, d).sort(dim=-1, descending=True).values.contiguous(), "file"


def model_target(model, *, trust_remote_code: bool = False) -> "ModelTarget":
    """``model`` (a MODEL spec, a :class:`~oscar_calib.model.load.LoadedModel` or a :class:`ModelTarget`)
    as a :class:`ModelTarget`; a spec is loaded on the CPU."""
    if isinstance(model, ModelTarget):
        return model
    if isinstance(model, str):
        from ...model.load import load_model

        model = load_model(model, device="cpu", trust_remote_code=trust_remote_code)
    return ModelTarget.from_loaded(model)


def import_rotations(read, model, out: Path, *, engine: str, clip: tuple[float | None, float | None] = (None, None),
                     group_size: int | None = None, sink_tokens: int = DEFAULT_SINK,
                     recent_tokens: int = DEFAULT_RECENT, overwrite: bool = False, trust_remote_code: bool = False,
                     source: dict | None = None) -> ImportResult:
    """Build a format-v1 artifact for ``model`` from an engine's K and V rotations: ``read(geometry)``
    returns the two :class:`~.base.ReadRotations` (an engine target's reader bound to its files).
    ``source`` (e.g. the hub repository a file came from) is recorded in the report and card."""
    k_clip = check_clip("k", BASELINE_CLIPS[0] if clip[0] is None else clip[0])
    v_clip = check_clip("v", BASELINE_CLIPS[1] if clip[1] is None else clip[1])
    check_window(sink_tokens, recent_tokens)
    out = Path(out)
    if out.is_dir() and (out / WEIGHTS_NAME).exists() and not overwrite:
        raise OutputExistsError(f"{out} already holds an artifact; pass --overwrite to replace it")
    target = model_target(model, trust_remote_code=trust_remote_code)
    if target.mixed_heads:
        raise UnsupportedModelError(f"{target.model_id}: its layers differ in head_dim or KV heads; oscar import reads "
                                    "engines' files of one head geometry (calibrate it with `oscar calibrate`)")
    n, h, d = target.num_layers, target.num_kv_heads, target.head_dim
    group_size = group_size or default_group_size(d)
    check_group_size(d, group_size)
    kf, vf = read(Geometry(n, h, d, target.layer_ids))        # a hybrid's files by the model's layer ids
    if vf.k_means is not None:                 # the fork reads k_mean from the K file only
        vf.notes.append("k_mean in the V file ignored (the fork reads the key mean from the K file only)")
    granularity = "head" if kf.per_head or vf.per_head else "layer"
    layers, eig_src = [], {"k": set(), "v": set()}
    for i in range(n):
        ke, ks = _eigen(kf, i, h, d)
        ve, vs = _eigen(vf, i, h, d)
        eig_src["k"].add(ks)
        eig_src["v"].add(vs)
        layers.append(LayerRotations(
            k_rotation=kf.rotations[i].expand(h, d, d).clone(), v_rotation=vf.rotations[i].expand(h, d, d).clone(),
            k_clip=torch.full((h,), k_clip), v_clip=torch.full((h,), v_clip), k_eigenvalues=ke, v_eigenvalues=ve,
            k_mean=None if kf.k_means is None else kf.k_means[i]))
    imported = {which: {"file": f.source, "sha256": f.sha256, "format_version": f.format_version,
                        "eigenvalues": "+".join(sorted(eig_src[which])), "dtype": f.source_dtype,
                        "notes": f.notes, "per_head": f.per_head}
                for which, f in (("k", kf), ("v", vf))}
    imported["engine"] = engine
    if source:
        imported["source"] = source
    calibration = {"data": IMPORTED, "tokens": 0, "sequences": 0, "seq_len": 0, "seed": 0, "clip": "fixed",
                   "imported": imported}
    settings = ArtifactSettings(num_layers=n, num_attention_heads=target.num_attention_heads, num_kv_heads=h,
                                head_dim=d, group_size=group_size, sink_tokens=sink_tokens,
                                recent_tokens=recent_tokens, granularity=granularity, shared_clips=(k_clip, v_clip),
                                key_centering=kf.k_means is not None, model_type=target.model_type,
                                layer_ids=target.layer_ids or ())
    metadata = {
        "format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "model_id": target.model_id,
        "model_fingerprint": target.fingerprint, "calibration": json.dumps(calibration, sort_keys=True),
        "toolkit_version": __version__,
        **({MODEL_SOURCE_METADATA: json.dumps(target.source, sort_keys=True)} if target.source else {}),
        **settings.metadata(),
    }
    artifact = Artifact(layers=layers, metadata=metadata, settings=settings)
    report = {"format_version": FORMAT_VERSION, "toolkit_version": __version__, "model_id": target.model_id,
              **({"model_source": target.source} if target.source else {}), "model_fingerprint": target.fingerprint, "group_size": group_size, "calibration": calibration,
              "geometry": target.geometry(), "imported": imported, "fingerprint_note": target.note,
              "settings": {"k_clip": k_clip, "v_clip": v_clip, "granularity": granularity,
                           "sink_tokens": sink_tokens, "recent_tokens": recent_tokens}}
    report[DIGEST_KEY] = stamp_artifact(artifact)          # what the card shows and the file stores
    with staged_dir(out, overwrite=overwrite, merge=True, last=WEIGHTS_NAME) as tmp:
        write_artifact_files(tmp, artifact, import_card(report), report)
        require_valid(tmp)
    artifact.path = out
    return ImportResult(out, artifact, report)


def import_card(report: dict) -> str:
    from ...contract.card import hub_id

    g, s, imp = report["geometry"], report["settings"], report["imported"]
    src = imp.get("source") or {}
    notes = [f"{w.upper()}: {note}." for w in ("k", "v") for note in imp[w]["notes"]]
    rows = [
        f"| base model | `{report['model_id']}` (fingerprint `{report['model_fingerprint'][:16]}…`"
        f"{'; ' + report['fingerprint_note'] if report.get('fingerprint_note') else ''}) |",
        f"| geometry | {g['num_layers']} layers, {g['num_attention_heads']} query / {g['num_kv_heads']} KV heads, "
        f"head_dim {g['head_dim']} |",
        f"| files | K `{imp['k']['file']}` (format_version {imp['k']['format_version']}, sha256 "
        f"`{imp['k']['sha256'][:16]}…`), V `{imp['v']['file']}` (format_version {imp['v']['format_version']}, "
        f"sha256 `{imp['v']['sha256'][:16]}…`) |",
    ]
    rows += [f"| {k} | {v} |" for k, v in src.items()]
    rows += [
        f"| granularity | {s['granularity']} |",
        f"| clips | fixed k={s['k_clip']}, v={s['v_clip']} (also the global pair an export serves) |",
        f"| eigenvalues | K: {imp['k']['eigenvalues']}, V: {imp['v']['eigenvalues']} |",
        f"| quantisation | INT2, group {report['group_size']}, BF16 sink {s['sink_tokens']} + recent "
        f"{s['recent_tokens']} tokens |",
        *([f"| content digest | `{report[DIGEST_KEY]}` (sha256 of tensors and metadata) |"] if report.get(DIGEST_KEY)
          else []),
    ]
    return "\n".join([
        "---", "library_name: oscar", "tags: [kv-cache, quantization, int2, oscar]",
        *([f"base_model: {hub_id(report)}"] if hub_id(report) else []), "---", "",
        f"# OSCAR rotations for {report['model_id']} (imported)", "",
        f"Imported by the `oscar` toolkit {report['toolkit_version']} from {imp['engine']} rotation files "
        f"(artifact format v{report['format_version']}).", "",
        "| setting | value |", "|---|---|", *rows, "",
        *([" ".join(notes), ""] if notes else []),
        "Quality has not been measured by oscar; run `oscar verify` on this directory.", "",
    ])
