"""What every export target shares: the engine revision its rules were restated from, the
settings a user passes, the launch settings an export writes, and the staged write that re-reads
the files with the engine's restated loader checks before anything is installed.

A target (one module per engine) subclasses :class:`ExportTarget` and supplies

* :attr:`~ExportTarget.serves`: the artifact settings its engine honours, as data (names of
  :data:`oscar_calib.contract.features.FEATURES`); for every other setting the artifact uses,
  :meth:`ExportTarget.export` prints the setting's one line (the engine serves the artifact without
  it) or refuses, for every target alike (:meth:`~ExportTarget.setting_lines`);
* :meth:`~ExportTarget.feature_wording` (optional): the engine's own, more precise line for a
  setting it drops;
* :meth:`~ExportTarget.refusals`: one line per other thing the engine cannot serve for this artifact;
* :meth:`~ExportTarget.write`: the engine's files in a staging directory, and its :class:`Launch`;
* :meth:`~ExportTarget.load_problems`: the engine's loader rules restated as oscar's own checks
  (the engine's code is read, cited, never copied);
* :meth:`~ExportTarget.read`: the K and V rotations back from the engine's files, for ``oscar import``.

:meth:`ExportTarget.export` is the same for every target: check, then :meth:`~ExportTarget.install`
(a target with files of its own layout overrides ``install``, never the checks).
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ... import __version__
from ...contract.artifact import Artifact, load_artifact
from ...contract.features import feature_lines
from ...errors import ArtifactError, InputError
from ...fsutil import atomic_write_text, staged_dir
from ...numerics.rotation import orthogonality_error

SETTINGS_FILE = "settings.json"
ENV_FILE = "serve.env"
LAUNCH_FILE = "launch.sh"

# transformers model types with sliding-window attention layers (their KV cache is windowed per layer)
SLIDING_MODEL_TYPES = ("gemma2", "gemma3", "gemma3_text", "gemma4", "gemma4_text", "gemma4_unified_text", "gpt_oss",
                       "llama4")

STATUSES = {
    "checked": "loader code read at the cited revision; its rules are restated in oscar's checks and tests",
    "partial": "loader code read, but the engine's pull request moved: some rules come from another revision",
    "unchecked": "no loader code readable: oscar refuses to write for it",
}


@dataclass(frozen=True)
class Checked:
    """The engine code a target's rules were restated from."""

    repo: str                       # owner/name (and branch or pull request)
    revision: str                   # the commit(s) read
    where: tuple[str, ...]          # "path: function" for each rule's source
    status: str = "checked"         # a key of STATUSES
    note: str = ""                  # what could not be checked

    def line(self) -> str:
        return f"{self.repo} @ {self.revision}"


@dataclass
class ExportSettings:
    """What a user may set for an export; None means the artifact's (or the engine's) value."""

    model_path: str | None = None
    clip: tuple[float | None, float | None] = (None, None)
    sink: int | None = None
    recent: int | None = None
    group_size: int | None = None
    folded: bool | None = None
    gguf: Path | None = None                # llama.cpp: the model GGUF the rotations are baked into
    onnx: Path | None = None                # ONNX Runtime: a GQA graph to patch
    prefill_backend: str = "fa3"            # SGLang


@dataclass
class Launch:
    """How the engine is started: environment variables and the command line, explicit values."""

    env: dict[str, str]
    argv: list[str]
    notes: list[str] = field(default_factory=list)

    def serve_env(self, title: str, warnings: list[str]) -> str:
        lines = [f"# {title}, written by `oscar export` (oscar {__version__})",
                 "# Load with `set -a; . serve.env; set +a`, or run ./launch.sh.",
                 *[f"# {n}" for n in self.notes], *[f"# WARNING: {w}" for w in warnings]]
        lines += [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return "\n".join(lines) + "\n"

    def launch_sh(self, title: str, relocate: dict[str, str]) -> str:
        """A script that loads serve.env, re-points the variables in ``relocate`` (env name -> file
        name) at its own directory, and runs :attr:`argv` with any extra arguments appended."""
        moves = "".join(f'export {k}="$here/{v}"\n' for k, v in relocate.items())
        cmd = " ".join(shlex.quote(a) for a in self.argv)
        return (f"#!/usr/bin/env bash\n# {title} (written by `oscar export`, oscar {__version__}).\n"
                f"# Usage: ./{LAUNCH_FILE} [more arguments for the engine]\nset -euo pipefail\n"
                f'here="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"\nset -a\n. "$here/{ENV_FILE}"\nset +a\n'
                f"{moves}exec {cmd} \"$@\"\n")


@dataclass
class Written:
    """What :meth:`ExportTarget.write` produced in the staging directory."""

    files: list[str]
    launch: Launch
    relocate: dict[str, str] = field(default_factory=dict)   # env name -> file name inside the export
    settings: dict = field(default_factory=dict)             # engine settings for settings.json
    warnings: list[str] = field(default_factory=list)


@dataclass
class ExportResult:
    out: Path
    target: str
    files: list[str]
    launch: Launch
    settings: dict
    checked: Checked
    warnings: list[str] = field(default_factory=list)
    detail: object = None           # a target's own record of what it wrote (SGLang: its SGLangExport)

    def to_dict(self) -> dict:
        return {"out": str(self.out), "target": self.target, "files": [str(self.out / f) for f in self.files],
                "env": self.launch.env, "argv": self.launch.argv, "settings": self.settings,
                "checked": asdict(self.checked), "warnings": self.warnings}


@dataclass(frozen=True)
class Geometry:
    """What a loader check needs to know about the model: its attention layers (``layer_ids``: the
    decoder-layer ids of the layers that hold a KV cache, None for ``0..num_layers-1``), KV heads and
    head_dim (layer 0's, and every layer's in ``layer_kv_heads`` / ``layer_head_dims`` when they
    differ)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_ids: tuple[int, ...] | None = None
    layer_kv_heads: tuple[int, ...] | None = None
    layer_head_dims: tuple[int, ...] | None = None

    @property
    def ids(self) -> tuple[int, ...]:
        return self.layer_ids if self.layer_ids is not None else tuple(range(self.num_layers))

    def heads(self, i: int) -> tuple[int, int]:
        """``(num_kv_heads, head_dim)`` of layer ``i`` (an index among the attention layers)."""
        return ((self.layer_kv_heads or (self.num_kv_heads,) * self.num_layers)[i],
                (self.layer_head_dims or (self.head_dim,) * self.num_layers)[i])

    @classmethod
    def of(cls, art: Artifact) -> "Geometry":
        st = art.settings
        return cls(art.num_layers, art.num_kv_heads, art.head_dim, st.layer_ids if st.mapped_layers else None,
                   *((st.layer_kv_heads, st.layer_head_dims) if st.mixed_heads else ()))


@dataclass
class ReadRotations:
    """One cache's rotations read back from an engine's files: ``rotations[i]`` ``[1, d, d]``
    (shared by the layer's KV heads) or ``[h, d, d]``, float32, for every layer of the model."""

    source: str                         # file (or file#part) it came from
    format_version: str                 # the engine's form, e.g. "vllm", "gguf-f32-transposed"
    rotations: list[torch.Tensor]
    sha256: str
    eigenvalues: list[torch.Tensor | None] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    source_dtype: str = "float32"
    k_means: list[torch.Tensor] | None = None   # every layer's mean key [h, d] (key centering), or None

    def __post_init__(self):
        if not self.eigenvalues:
            self.eigenvalues = [None] * len(self.rotations)

    @property
    def per_head(self) -> bool:
        return any(r.shape[0] > 1 for r in self.rotations)


class ExportTarget:
    """One serving engine's form of an artifact (see the module docstring)."""

    name: str = ""
    engine: str = ""
    summary: str = ""
    checked: Checked
    reads: str = ""            # what `oscar import --from NAME` takes, for --help and errors
    serves: frozenset[str] = frozenset()    # the artifact settings (contract.features.FEATURES) it honours

    # -- to implement -----------------------------------------------------------------------
    def refusals(self, art: Artifact, s: ExportSettings) -> list[str]:
        return []

    def feature_wording(self, name: str, art: Artifact, s: ExportSettings) -> str | None:
        """The engine's own line for a setting it drops (None: the setting's generic line)."""
        return None

    def write(self, art: Artifact, tmp: Path, final: Path, s: ExportSettings) -> Written:
        raise NotImplementedError

    def load_problems(self, out: Path, geo: Geometry) -> list[str]:
        raise NotImplementedError

    def read(self, paths: list[Path], geo: Geometry) -> tuple[ReadRotations, ReadRotations]:
        raise NotImplementedError

    # -- shared -----------------------------------------------------------------------------
    def setting_lines(self, art: Artifact, s: ExportSettings) -> tuple[list[str], list[str]]:
        """``(warnings, refusals)`` from :attr:`serves`: one line per setting the artifact uses and
        the engine does not serve (:func:`~oscar_calib.contract.features.feature_lines`)."""
        return feature_lines(art.settings, self.serves, self.engine, lambda n: self.feature_wording(n, art, s))

    def export(self, artifact_path: Path, out: Path, s: ExportSettings, *, overwrite: bool = False) -> ExportResult:
        """Write the engine's files for the artifact into ``out``: refused in one line when the
        engine cannot serve it (:meth:`setting_lines`, :meth:`refusals`); every setting it drops is
        named in one warning; then :meth:`install`."""
        if self.checked.status == "unchecked":
            raise InputError(f"--target {self.name}: {self.checked.note or 'no loader code could be read'}; "
                             "oscar does not write for a loader it could not check")
        art = load_artifact(artifact_path)              # every check of oscar validate, the digest included
        warnings, why = self.setting_lines(art, s)
        why += self.refusals(art, s)
        if why:
            raise ArtifactError(f"{self.engine} cannot serve {artifact_path}: {why[0]}")
        return self.install(art, Path(artifact_path), Path(out), s, warnings, overwrite=overwrite)

    def install(self, art: Artifact, artifact_path: Path, out: Path, s: ExportSettings, warnings: list[str], *,
                overwrite: bool = False) -> ExportResult:
        """Write the files (:meth:`write`) in a staging directory, re-read them with
        :meth:`load_problems` there and move them into ``out`` only when they pass. ``warnings``:
        the settings the engine drops, first in the export's warnings."""
        with staged_dir(out, overwrite=overwrite, merge=True) as tmp:
            w = self.write(art, tmp, out.resolve(), s)
            w.warnings[:0] = warnings
            problems = self.load_problems(tmp, Geometry.of(art))
            if problems:
                raise ArtifactError(f"the files written for {self.engine} fail its loader's checks: {problems[0]}")
            title = f"{self.engine} settings for {art.metadata.get('model_id')} ({self.checked.line()})"
            settings = {"target": self.name, "engine": self.engine, "checked": asdict(self.checked),
                        "artifact": str(Path(artifact_path).resolve()), "model_id": art.metadata.get("model_id"),
                        "model_fingerprint": art.metadata.get("model_fingerprint"), "env": w.launch.env,
                        "argv": w.launch.argv, **w.settings, "warnings": w.warnings, "toolkit_version": __version__}
            launch_files = [ENV_FILE, LAUNCH_FILE] if w.launch.argv else []    # an engine with a command line
            if launch_files:
                atomic_write_text(tmp / ENV_FILE, w.launch.serve_env(title, w.warnings))
                atomic_write_text(tmp / LAUNCH_FILE, w.launch.launch_sh(title, w.relocate))
                os.chmod(tmp / LAUNCH_FILE, 0o755 & ~_umask())
            atomic_write_text(tmp / SETTINGS_FILE, json.dumps(settings, indent=2, sort_keys=True, default=str) + "\n")
        files = [*w.files, *launch_files, SETTINGS_FILE]
        return ExportResult(out, self.name, files, w.launch, w.settings, self.checked, w.warnings)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ----------------------------------------------------------------------------- helpers for targets

WINDOWED_KINDS = {"sliding_attention": "sliding-window", "chunked_attention": "chunked"}   # a layer reads a window


def sliding_window_note(art: Artifact) -> str | None:
    """Why the artifact's model has layers that attend to a window only, sliding or chunked (None
    when it has none)."""
    types = ((art.report or {}).get("geometry") or {}).get("layer_types") or []
    kinds = [WINDOWED_KINDS[t] for t in WINDOWED_KINDS if t in types]
    if kinds:
        n = sum(t in WINDOWED_KINDS for t in types)
        return f"{art.metadata.get('model_id')} has {n} {' and '.join(kinds)} attention layers"
    if art.metadata.get("model_type") in SLIDING_MODEL_TYPES:
        return f"{art.metadata.get('model_id')} ({art.metadata.get('model_type')}) has sliding-window attention layers"
    return None


def shared_rotations(art: Artifact, which: str, engine: str) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Every layer's one ``[d, d]`` rotation for ``which`` (``"k"``/``"v"``) and its eigenvalues,
    or :class:`ArtifactError` saying what an engine that loads one rotation per layer loses."""
    missing = shared_missing(art)
    if missing:
        raise ArtifactError(f"{engine}: {missing}")
    pairs = [art.shared_rotation(i, which) for i in range(art.num_layers)]
    return [p[0].float() for p in pairs], [p[1] for p in pairs]


def shared_missing(art: Artifact) -> str | None:
    """One line when the artifact has per-KV-head rotations and no shared per-layer ones."""
    if any(art.shared_rotation(i, "k") is None or art.shared_rotation(i, "v") is None
           for i in range(art.num_layers)):
        return ("it loads one [head_dim, head_dim] rotation per layer, and this artifact has only per-KV-head "
                f"rotations ({art.num_kv_heads} per layer) and no shared per-layer ones (made before oscar 0.2): "
                "re-run `oscar calibrate` to add them; serving one head's rotation for all would lose the per-head fit")
    return None


def per_head_note(art: Artifact, engine: str, method: str) -> str | None:
    """What exporting the shared rotation of a per-KV-head artifact gives up (None otherwise);
    ``method``: the ``oscar eval`` method that measures the engine's scheme."""
    if art.granularity == "head" and art.num_kv_heads > 1:
        return (f"{engine} loads one rotation per layer: this export serves the artifact's shared per-layer rotations, "
                f"not its {art.num_kv_heads} per-KV-head ones (`oscar eval --methods oscar,{method}` shows the cost)")
    return None


def rotation_problem(r, where: str, shape: tuple[int, ...], tol: float) -> str | None:
    """The first reason ``r`` is not a finite, orthogonal floating tensor of ``shape``, or None."""
    if not isinstance(r, torch.Tensor):
        return f"{where} is not a tensor"
    if tuple(r.shape) != tuple(shape):
        return f"{where} has shape {list(r.shape)}, expected {list(shape)}"
    if not r.is_floating_point() or not torch.isfinite(r).all():
        return f"{where} is not a finite floating-point tensor"
    err = orthogonality_error(r)
    if err >= tol:
        return f"{where} is not orthogonal (‖RRᵀ − I‖∞ = {err:.2e})"
    return None


def wrong_paths(target: ExportTarget, paths, wanted: str):
    """Raise the one-line error for ``oscar import --from TARGET`` given the wrong number of paths."""
    raise InputError(f"--from {target.name} reads {wanted} ({target.reads}); got {len(paths)} path(s)")
