"""The artifact contract, format version 1: the artifact in memory, reading and writing.

The names of its files, tensors and metadata keys are in :mod:`.layout`, every check in
:mod:`.checks`, the content digest in :mod:`.digest`; this module builds on them.

Writes are atomic (temporary name in the same directory, then ``os.replace``) and
deterministic: the safetensors header is serialised with sorted keys, so the same tensors and
metadata give byte-identical files (the stock serialiser orders metadata by hash). Every write
stores the content digest (``content_sha256``) of what it writes, and every read refuses a file
whose content no longer matches it.

Importing this module does not import torch (``oscar zoo list`` and ``oscar validate`` read
headers and check structure without it); the functions that build or load tensors import it.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..errors import ArtifactError, OscarError, OscarWarning
from ..fsutil import atomic_write_files
from . import stfile
from .checks import inspect_bytes, read_file
from .digest import content_digest
from .features import layer_span
from .layout import (
    CARD_NAME,
    DIGEST_KEY,
    GEOMETRY_KEYS,
    KINDS,
    LAYER_HEAD_DIMS_METADATA,
    LAYER_IDS_METADATA,
    LAYER_KV_HEADS_METADATA,
    MODEL_SOURCE_METADATA,
    REPORT_NAME,
    WEIGHTS_NAME,
    dtype_name,
    tensor_name,
)
from .settings import ArtifactSettings, GroupPair
from .values import model_source_problems, value_problems

if TYPE_CHECKING:
    import torch


@dataclass
class LayerRotations:
    """One decoder layer's entry: tensors per KV head, optionally the layer's shared rotation and,
    for an artifact with key centering, the mean key of every KV head ``k_mean [h, d]``."""

    k_rotation: torch.Tensor
    v_rotation: torch.Tensor
    k_clip: torch.Tensor
    v_clip: torch.Tensor
    k_eigenvalues: torch.Tensor
    v_eigenvalues: torch.Tensor
    k_layer_rotation: torch.Tensor | None = None
    v_layer_rotation: torch.Tensor | None = None
    k_layer_eigenvalues: torch.Tensor | None = None
    v_layer_eigenvalues: torch.Tensor | None = None
    k_mean: torch.Tensor | None = None


def check_key_means(layers: list[LayerRotations], settings: ArtifactSettings) -> None:
    """Key means (``k_mean``) on every layer exactly when ``settings`` say the keys are centered."""
    having = sum(lr.k_mean is not None for lr in layers)
    if having not in (0, len(layers)) or bool(having) != settings.key_centering:
        raise ArtifactError(f"{having} of {len(layers)} layers hold a key mean (k_mean) but the settings say "
                            f"key_centering={settings.key_centering}: every layer or none, as they say")


@dataclass
class Artifact:
    """An artifact in memory: per-layer tensors, string metadata and its typed
    :class:`~.settings.ArtifactSettings` (parsed from the metadata when not given: an artifact that
    cannot be read cannot be built)."""

    layers: list[LayerRotations]
    metadata: dict[str, str]
    path: Path | None = None
    report: dict = field(default_factory=dict)
    content_sha256: str | None = None       # the digest of the content as loaded or last written
    settings: ArtifactSettings | None = None

    def __post_init__(self) -> None:
        if self.settings is None:
            self.settings = ArtifactSettings.from_metadata(self.metadata)
        check_key_means(self.layers, self.settings)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_kv_heads(self) -> int:
        return self.settings.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.settings.head_dim

    @property
    def group_size(self) -> int:
        return self.settings.group_size

    @property
    def layer_groups(self) -> tuple[GroupPair, ...]:
        """Every layer's :class:`~.settings.GroupPair` (keys, values)."""
        return self.settings.layer_groups

    @property
    def logit_correction(self) -> float:
        """The gain of the logit-noise correction (0: off)."""
        return self.settings.logit_correction

    @property
    def granularity(self) -> str:
        return self.settings.granularity

    def shared_rotation(self, layer: int, which: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's one rotation for all KV heads ``[d, d]`` and its eigenvalues ``[d]``
        (descending), for ``which`` in ``"k"``/``"v"``: the stored shared rotation, or the per-head
        one when every head has the same (granularity ``layer``, or one KV head); None for a
        per-head artifact made before shared rotations were stored."""
        lr = self.layers[layer]
        stored = getattr(lr, f"{which}_layer_rotation")
        if stored is not None:
            return stored, getattr(lr, f"{which}_layer_eigenvalues")
        if self.granularity == "layer" or self.num_kv_heads == 1:
            return getattr(lr, f"{which}_rotation")[0], getattr(lr, f"{which}_eigenvalues")[0]
        return None

    def shared_clips(self) -> tuple[float, float] | None:
        """The fitted (K, V) clip ratios for the shared rotations, or None when not recorded."""
        return self.settings.shared_clips

    def tensors(self) -> dict[str, torch.Tensor]:
        import torch

        out = {}
        for i, layer in enumerate(self.layers):
            for kind in KINDS:
                t = getattr(layer, kind)
                if t is not None:
                    out[tensor_name(i, kind)] = t.detach().to("cpu", torch.float32).contiguous()
        return out

    def value_problems(self) -> list[str]:
        """What :func:`.values.check_values` finds in the tensors (finite, orthogonal, clips, ...)."""
        return value_problems(self.tensors(), self.metadata)


def model_source(md: dict[str, str]) -> dict[str, str] | None:
    """The ``model_source`` record (None when absent); :class:`ArtifactError` when malformed
    (:func:`model_source_problems`)."""
    problems = model_source_problems(md)
    if problems:
        raise ArtifactError(problems[0])
    raw = md.get(MODEL_SOURCE_METADATA)
    return None if raw is None else json.loads(raw)


# ----------------------------------------------------------------------------- bytes

def tensor_entries(tensors: dict[str, torch.Tensor]) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    """``(name, dtype tag, shape, bytes)`` of torch tensors, as a safetensors file stores them."""
    import torch

    out = []
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        if dtype_name(t) not in stfile.DTYPE_TAGS:
            raise ArtifactError(f"cannot store dtype {t.dtype} for {name}")
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out.append((name, stfile.DTYPE_TAGS[dtype_name(t)], tuple(t.shape), raw))
    return out


def serialize_artifact(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """Canonical safetensors bytes of an artifact (:func:`.stfile.serialize`) with its content
    digest stored in the metadata (``content_sha256``; one given is replaced)."""
    entries = tensor_entries(tensors)
    return stfile.serialize(entries, stamp(metadata, entries))


def stamp(metadata: dict[str, str], entries) -> dict[str, str]:
    """``metadata`` (values as strings) with ``content_sha256`` set to the digest of it and ``entries``."""
    md = {str(k): str(v) for k, v in metadata.items() if k != DIGEST_KEY}
    return md | {DIGEST_KEY: content_digest(md, entries)}


# ----------------------------------------------------------------------------- read / write

def has_artifact(directory: Path) -> bool:
    return (Path(directory) / WEIGHTS_NAME).exists()


def write_artifact_files(directory: Path, artifact: Artifact, card: str, report: dict) -> Path:
    """Write the three files of an artifact into an existing ``directory``. All three are written
    under temporary names first and then renamed into place, the safetensors file last, so a kill
    or a full disk while writing leaves the old artifact (or none), never a new card beside old
    tensors or a partial ``oscar.safetensors``. The artifact's metadata, and the report written,
    gain the content digest that was written (:func:`stamp`)."""
    directory = Path(directory)
    entries = tensor_entries(artifact.tensors())
    metadata = stamp(artifact.metadata, entries)
    report = dict(report, **{DIGEST_KEY: metadata[DIGEST_KEY]})
    atomic_write_files(directory, {
        REPORT_NAME: (json.dumps(report, indent=2, sort_keys=True) + "\n").encode(),
        CARD_NAME: card.encode(),
        WEIGHTS_NAME: stfile.serialize(entries, metadata),
    }, last=WEIGHTS_NAME)
    artifact.path, artifact.metadata, artifact.content_sha256 = directory, metadata, metadata[DIGEST_KEY]
    return directory / WEIGHTS_NAME


def stamp_artifact(artifact: Artifact) -> str:
    """Store the content digest of ``artifact`` (as it would be written) in its metadata and
    return it: what a writer calls before it renders a card or report that shows the digest."""
    entries = tensor_entries(artifact.tensors())
    artifact.metadata = stamp(artifact.metadata, entries)
    artifact.content_sha256 = artifact.metadata[DIGEST_KEY]
    return artifact.content_sha256


def read_metadata(path: Path) -> dict[str, str]:
    """The metadata of an artifact file, reading only its header (no tensor data, no digest check:
    for listings; a reader uses :func:`load_artifact`)."""
    path = _weights_path(path)
    try:
        header, _ = stfile.read_header(path)
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read ({e.strerror or e})") from None
    except OscarError as e:
        raise ArtifactError(f"{path}: {e}") from None
    return {str(k): str(v) for k, v in (header.get("__metadata__") or {}).items()}


def _weights_path(path: Path) -> Path:
    path = Path(path)
    if path.is_dir():
        path = path / WEIGHTS_NAME
    if not path.exists():
        raise ArtifactError(f"no artifact at {path}")
    return path


def load_artifact(path: Path) -> Artifact:
    """Load an artifact directory (or its ``oscar.safetensors``), refused (:class:`ArtifactError`,
    the first problem) unless every check of :mod:`.checks` passes on the bytes read: the contract's
    structure, sound metadata and values (finite, orthogonal rotations, clips in (0, 1], ...) and a
    content digest that matches, so no reader ever uses a NaN, a non-orthogonal rotation or a file
    changed after it was written. A file without a digest loads with an :class:`OscarWarning`.
    The tensors are built from the same bytes that were checked."""
    import numpy as np
    import torch

    wpath = _weights_path(path)
    report, arrays = inspect_bytes(read_file(wpath), path)
    if not report.ok:
        raise report.error()
    for w in report.warnings:
        warnings.warn(f"{path}: {w}", OscarWarning, stacklevel=2)
    tensors = {name: torch.from_numpy(np.array(a)) for name, a in arrays.items()}
    n = report.settings.num_layers
    layers = [LayerRotations(**{k: tensors.get(tensor_name(i, k)) for k in KINDS})
              for i in range(n)]
    rep = {}
    rpath = wpath.parent / REPORT_NAME
    if rpath.exists():
        try:
            rep = json.loads(rpath.read_text())
        except ValueError:
            rep = {}
    return Artifact(layers=layers, metadata=report.metadata, path=wpath.parent, report=rep,
                    content_sha256=report.content_sha256, settings=report.settings)


def valid_artifact(artifact: "Artifact | Path | str") -> Artifact:
    """An artifact every reader may use: a path is loaded (:func:`load_artifact`, every check on
    the bytes read); an artifact in memory has its settings checked when it was built and its
    tensors checked here. :class:`ArtifactError` with the first problem otherwise."""
    if not isinstance(artifact, Artifact):
        return load_artifact(Path(artifact))
    problems = artifact.value_problems()
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ArtifactError(f"{artifact.path or 'the artifact'}: {problems[0]}{more}")
    return artifact


# ----------------------------------------------------------------------------- artifact vs model

def compatibility_problems(metadata: dict[str, str], geometry, fingerprint: str | None, *,
                           model_name: str = "this model") -> list[str]:
    """Why an artifact (its ``metadata``) does not belong to a model with ``geometry`` (anything with
    ``num_layers``, ``num_attention_heads``, ``num_kv_heads``, ``head_dim`` of its attention layers,
    and optionally their ``ids``, ``head_dims`` and ``kv_heads``, as
    :class:`~oscar_calib.model.geometry.Geometry` has them) and ``fingerprint`` (None: not checked).
    Empty when it does. The one artifact-matches-model check of the toolkit: it compares the
    attention layers only (a hybrid model's others have no artifact layer)."""
    problems = []
    for key in GEOMETRY_KEYS:
        have, want = metadata.get(key), getattr(geometry, key)
        if have is not None and str(have) != str(want):
            problems.append(f"{key} is {have} but {model_name} has {want}")
    n = getattr(geometry, "num_layers", None)
    for key, attr, what in ((LAYER_IDS_METADATA, "ids", "the model's layers"),
                            (LAYER_HEAD_DIMS_METADATA, "head_dims", "head_dims"),
                            (LAYER_KV_HEADS_METADATA, "kv_heads", "KV heads")):
        want = getattr(geometry, attr, None)
        if problems or want is None or n is None:
            continue
        default = list(range(n)) if key == LAYER_IDS_METADATA else \
            [int(metadata.get("head_dim" if attr == "head_dims" else "num_kv_heads", 0) or 0)] * n
        have = _layer_ints(metadata.get(key)) or default
        if list(have) != list(want):
            problems.append(f"the artifact's layers have {what} {layer_span(have)} but {model_name}'s attention layers "
                            f"have {layer_span(want)}")
    if fingerprint is not None and metadata.get("model_fingerprint") != fingerprint:
        problems.append(f"model fingerprint {str(metadata.get('model_fingerprint'))[:12]}… does not match "
                        f"{model_name} ({fingerprint[:12]}…): calibrated for another model "
                        f"({metadata.get('model_id')!r}) or config; calibrate this model with `oscar calibrate`")
    return problems


def _layer_ints(raw) -> list[int] | None:
    """A per-layer metadata list (``"3,7,11"``) as integers, None when absent or malformed (the
    settings' own check names a malformed one)."""
    parts = str(raw).split(",") if raw is not None else []
    return [int(x) for x in parts] if parts and all(x.strip().isdigit() for x in parts) else None


def require_compatible(artifact: "Artifact | dict[str, str]", geometry, fingerprint: str | None, *,
                       model_name: str = "this model") -> None:
    """Raise :class:`ArtifactError` (naming the artifact) unless it belongs to the model."""
    md = artifact.metadata if isinstance(artifact, Artifact) else artifact
    problems = compatibility_problems(md, geometry, fingerprint, model_name=model_name)
    if problems:
        where = getattr(artifact, "path", None) or "the artifact"
        raise ArtifactError(f"{where}: {problems[0]}")


def checked_artifact(artifact: "Artifact | Path | str", identity: Callable[[], tuple], *,
                     model_name: str = "this model") -> Artifact:
    """``artifact`` (a path or an :class:`Artifact`) refused before anything is built from it when
    it is invalid (:func:`valid_artifact`) or was calibrated for another model
    (:func:`require_compatible`). ``identity()`` gives the model's ``(geometry, fingerprint)``
    (fingerprint None: not checked, e.g.
    :func:`~oscar_calib.model.geometry.model_identity`); it is asked only once the artifact is
    valid, so an invalid artifact is refused before anything of the model is read."""
    art = valid_artifact(artifact)
    require_compatible(art, *identity(), model_name=model_name)
    return art
