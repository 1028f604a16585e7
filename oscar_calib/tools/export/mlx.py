"""``oscar export --target mlx-lm``: an artifact as mlx-lm's OSCAR cache loads it (pull request
ml-explore/mlx-lm#1789, closed without being merged; ``mlx_lm/models/oscar.py`` read at 117afde2c6:
``load_rotations``, ``_rotation_layers``, ``_rotation_matrix``, ``OscarKVCache._rotate``,
``int2_quantize``, ``OscarConfig``; nothing copied).

===========================================================  =========================================
rule                                                         where
===========================================================  =========================================
a directory with ``k_rotation.safetensors`` and              ``load_rotations``
``v_rotation.safetensors`` (or one shared
``rotation.safetensors``)
keys ``layer_<i>``: when their count is the model's layer    ``_rotation_layers``
count they are taken in index order, otherwise
``layer_0 .. layer_{L-1}`` must all be there
each ``[D, D]`` or ``[H, D, D]``, square                     ``_rotation_matrix``
applied as ``x @ Mᵀ`` (``_rotate``): the file holds ``Rᵀ``    ``OscarKVCache._rotate``
for oscar's ``x @ R``; a ``[H, D, D]`` stack broadcasts
over the KV heads
settings are Python arguments (``OscarConfig``: group size,  ``OscarConfig``, ``int2_quantize``
sink, recent, clip ratios in ``(0, 1)`` or None), one group
size for every layer, and the clip is taken per GROUP
===========================================================  =========================================
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ...contract import stfile
from ...contract.artifact import tensor_entries
from ...contract.defaults import ORTHOGONALITY_TOL
from ...errors import ArtifactError
from ...fsutil import atomic_write_bytes, atomic_write_text
from .base import (
    Checked,
    ExportSettings,
    ExportTarget,
    Geometry,
    Launch,
    ReadRotations,
    Written,
    rotation_problem,
    wrong_paths,
)
from .uniform import serving_clips, uniform_group_note

FILES = {"k": "k_rotation.safetensors", "v": "v_rotation.safetensors"}
CONFIG_FILE = "oscar_config.json"


def to_mlx(r: torch.Tensor) -> torch.Tensor:
    """oscar's ``R`` (``x @ R``) as mlx-lm stores it (``x @ Mᵀ``): ``Rᵀ`` (per head for a stack)."""
    return r.detach().to("cpu", torch.float32).transpose(-1, -2).contiguous()


class MlxTarget(ExportTarget):
    name = "mlx-lm"
    engine = "mlx-lm"
    summary = "mlx-lm PR #1789 (closed, unmerged): k/v_rotation.safetensors, layer_<i>, stored transposed"
    reads = "k_rotation.safetensors v_rotation.safetensors (layer_<i>: [D, D] or [H, D, D], transposed)"
    checked = Checked(
        "ml-explore/mlx-lm (PR #1789, closed unmerged)", "117afde2c6",
        ("mlx_lm/models/oscar.py: load_rotations, _rotation_layers, _rotation_matrix, OscarKVCache._rotate, "
         "int2_quantize, OscarConfig",),
        status="partial", note="the pull request was closed without being merged: no mlx-lm release loads these "
                               "files; its settings are Python arguments, not a command line")

    # layer_<i> [D, D] or [H, D, D] (per KV head), each layer's own D and H (_rotation_matrix checks squareness only,
    # OscarKVCache._rotate the layer's head_dim); OscarConfig: one group_size, sink and recent windows
    serves = frozenset({"per_head_rotations", "windows", "layer_head_dims"})

    def feature_wording(self, name: str, art, s: ExportSettings) -> str | None:
        if name == "layer_ids":
            return ("the artifact's layers are a hybrid model's attention layers, and mlx-lm's load_rotations numbers "
                    "layer_<i> over the cache layers its caller passes (117afde2c6); which of a hybrid model's layers "
                    "get an OSCAR cache was not read, so it could put the rotations on the wrong layers")
        return uniform_group_note(art, self.engine) if name == "layer_group_sizes" else None

    def write(self, art, tmp: Path, final: Path, s: ExportSettings) -> Written:
        st = art.settings
        folded = st.v_folded if s.folded is None else s.folded
        per_head = st.per_head
        for which in ("k", "v"):
            tensors = {}
            for i, lr in enumerate(art.layers):
                r = getattr(lr, f"{which}_rotation").float()
                if which == "v" and folded:
                    r = torch.eye(r.shape[-1]).expand_as(r)
                tensors[f"layer_{i}"] = to_mlx(r if per_head else r[0])
            atomic_write_bytes(tmp / FILES[which], stfile.serialize(tensor_entries(tensors), {"format": "mlx-lm-oscar"}))
        k_clip, v_clip, source = serving_clips(art, s.clip)
        group = s.group_size or art.group_size
        config = {"group_size": group, "sink_tokens": st.sink_tokens if s.sink is None else s.sink,
                  "recent_tokens": st.recent_tokens if s.recent is None else s.recent,
                  "rotation_dir": str(final), "absorb_v_rotation": False,
                  "k_clip_ratio": k_clip if k_clip < 1 else None, "v_clip_ratio": v_clip if v_clip < 1 else None}
        atomic_write_text(tmp / CONFIG_FILE, json.dumps(config, indent=2) + "\n")
        warnings = ["mlx-lm clips per INT2 group (the ratio's index taken within each group), not per head "
                        "vector as oscar calibrated it"]
        notes = ["no command line: pass OscarConfig(**oscar_config.json) to mlx-lm's OSCAR prompt cache (PR #1789)"]
        settings = {"config": config, "clip_source": source, "rotations": "per KV head" if per_head else "per layer"}
        return Written([*FILES.values(), CONFIG_FILE], Launch({}, [], notes), {}, settings, warnings)

    def load_problems(self, out: Path, geo: Geometry) -> list[str]:
        problems = []
        for which in ("k", "v"):
            try:
                read_mlx_file(Path(out) / FILES[which], geo)
            except ArtifactError as e:
                problems.append(str(e))
        return problems

    def read(self, paths: list[Path], geo: Geometry) -> tuple[ReadRotations, ReadRotations]:
        if len(paths) != 2:
            wrong_paths(self, paths, "a K file and a V file")
        return read_mlx_file(Path(paths[0]), geo), read_mlx_file(Path(paths[1]), geo)


def read_mlx_file(path: Path, geo: Geometry) -> ReadRotations:
    """The rotations mlx-lm applies from ``path`` (module docstring), as oscar's ``x @ R``."""
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except Exception as e:  # noqa: BLE001 - a missing or damaged file, one line
        raise ArtifactError(f"{path}: not a readable safetensors file ({type(e).__name__})") from None
    numbered = sorted((int(k[6:]), k) for k in tensors if k.startswith("layer_") and k[6:].isdigit())
    keys = [k for _, k in numbered] if len(numbered) == geo.num_layers else [f"layer_{i}" for i in
                                                                             range(geo.num_layers)]
    rots = []
    for i, key in enumerate(keys):
        h, d = geo.heads(i)
        t = tensors.get(key)
        if t is None:
            raise ArtifactError(f"{path.name}: no {key} (mlx-lm needs layer_0..layer_{geo.num_layers - 1})")
        shape = (d, d) if t.dim() == 2 else (h, d, d)
        p = rotation_problem(t, f"{path.name}: {key}", shape, ORTHOGONALITY_TOL)
        if p:
            raise ArtifactError(p)
        r = t.float().transpose(-1, -2)
        rots.append(r.unsqueeze(0) if r.dim() == 2 else r.contiguous())
    raw = path.read_bytes()
    return ReadRotations(path.name, "mlx-transposed", rots, hashlib.sha256(raw).hexdigest())


TARGET = MlxTarget()
