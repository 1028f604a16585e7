"""The artifact contract, format version 1: tensor names, metadata keys, reading and writing.

This module is the one place that names the tensors and metadata of ``oscar.safetensors``.

Layout of an artifact directory::

    <out>/oscar.safetensors     rotations, clips and eigenvalues (float32)
    <out>/README.md             model card
    <out>/calibration.json      per-layer report, timings, settings

Writes are atomic (temporary name in the same directory, then ``os.replace``) and
deterministic: the safetensors header is serialised with sorted keys, so the same tensors and
metadata give byte-identical files (the stock serialiser orders metadata by hash).

Importing this module does not import torch (``oscar zoo list`` and ``oscar validate`` read
headers and check structure without it); the functions that build or load tensors import it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .. import FORMAT_VERSION
from ..errors import ArtifactError
from ..fsutil import atomic_write_files

if TYPE_CHECKING:
    import torch

WEIGHTS_NAME = "oscar.safetensors"
CARD_NAME = "README.md"
REPORT_NAME = "calibration.json"
PULL_RECORD = ".oscar-pull.json"      # where an artifact came from, written by `oscar pull` (hidden: never pushed)
FORMAT_NAME = "oscar-rotations"

TENSOR_KINDS = ("k_rotation", "v_rotation", "k_clip", "v_clip", "k_eigenvalues", "v_eigenvalues")
# Optional, additive (toolkit 0.2): one rotation per layer shared by all its KV heads, computed from the
# pooled statistics, for engines that take one rotation per layer (the OSCAR SGLang fork's main). All of
# them or none, for every layer; eigenvalues descending like the per-head ones.
SHARED_KINDS = ("k_layer_rotation", "v_layer_rotation", "k_layer_eigenvalues", "v_layer_eigenvalues")
# Optional metadata (toolkit 0.2): the one K and one V clip ratio fitted for the shared rotations
# (an engine that applies one ratio per cache for the whole model).
SHARED_CLIP_METADATA = ("fork_k_clip", "fork_v_clip")
# Optional metadata (toolkit 0.3): the INT2 group size of every layer, comma separated (K and V of a layer
# share it), when a bit budget gave layers different sizes (`oscar calibrate --bit-budget`). ``group_size``
# then holds the closest uniform size within the same budget (what an engine with one size serves).
LAYER_GROUPS_METADATA = "layer_group_sizes"
# Optional metadata (toolkit 0.3): where the model came from, a JSON object (``model_id`` stays the
# model's name): ``kind`` (alias | local | gguf | hub); ``alias`` (a pip-shipped model's name) or
# ``path`` (the absolute directory or .gguf file a local model was read from); ``hub_id`` when
# known. Tools load the model from it (``model.load.model_for_artifact``); the card shows it.
MODEL_SOURCE_METADATA = "model_source"
MODEL_SOURCE_KINDS = ("alias", "local", "gguf", "hub")
MODEL_SOURCE_FIELDS = ("kind", "alias", "path", "hub_id")

REQUIRED_METADATA = (
    "format", "format_version", "model_id", "model_fingerprint", "num_layers",
    "num_attention_heads", "num_kv_heads", "head_dim", "group_size", "bits", "sink_tokens",
    "recent_tokens", "k_objective", "v_objective", "composition", "granularity", "calibration",
    "toolkit_version",
)
INT_METADATA = ("format_version", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim",
                "group_size", "bits", "sink_tokens", "recent_tokens")


def tensor_name(layer: int, kind: str) -> str:
    if kind not in TENSOR_KINDS and kind not in SHARED_KINDS:
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
    return (num_kv_heads, head_dim)


@dataclass
class LayerRotations:
    """One decoder layer's entry: tensors per KV head, and optionally the layer's shared rotation."""

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


@dataclass
class Artifact:
    """An artifact in memory: per-layer tensors plus string metadata."""

    layers: list[LayerRotations]
    metadata: dict[str, str]
    path: Path | None = None
    report: dict = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_kv_heads(self) -> int:
        return int(self.metadata["num_kv_heads"])

    @property
    def head_dim(self) -> int:
        return int(self.metadata["head_dim"])

    @property
    def group_size(self) -> int:
        return int(self.metadata["group_size"])

    @property
    def layer_group_sizes(self) -> list[int]:
        """Every layer's INT2 group size: ``layer_group_sizes`` when stored, else ``group_size``."""
        return layer_group_sizes(self.metadata) or [self.group_size] * self.num_layers

    @property
    def granularity(self) -> str:
        return self.metadata.get("granularity", "head")

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
        md = self.metadata
        if not all(k in md for k in SHARED_CLIP_METADATA):
            return None
        return float(md["fork_k_clip"]), float(md["fork_v_clip"])

    def tensors(self) -> dict[str, torch.Tensor]:
        import torch

        out = {}
        for i, layer in enumerate(self.layers):
            for kind in TENSOR_KINDS + SHARED_KINDS:
                t = getattr(layer, kind)
                if t is not None:
                    out[tensor_name(i, kind)] = t.detach().to("cpu", torch.float32).contiguous()
        return out


def layer_group_sizes(md: dict[str, str]) -> list[int] | None:
    """The stored per-layer group sizes (None when absent); :class:`ArtifactError` when unreadable
    or not one power of two dividing head_dim per layer (:func:`layer_group_problems`)."""
    problems = layer_group_problems(md)
    if problems:
        raise ArtifactError(problems[0])
    raw = md.get(LAYER_GROUPS_METADATA)
    return None if raw is None else [int(x) for x in raw.split(",")]


def model_source(md: dict[str, str]) -> dict[str, str] | None:
    """The ``model_source`` record (None when absent); :class:`ArtifactError` when malformed
    (:func:`model_source_problems`)."""
    problems = model_source_problems(md)
    if problems:
        raise ArtifactError(problems[0])
    raw = md.get(MODEL_SOURCE_METADATA)
    return None if raw is None else json.loads(raw)


def model_source_problems(md: dict[str, str]) -> list[str]:
    """Why ``model_source`` is unusable (empty when absent or fine): not a JSON object of strings,
    an unknown field or kind, or no ``alias`` / ``path`` where its kind needs one."""
    raw = md.get(MODEL_SOURCE_METADATA)
    if raw is None:
        return []
    try:
        rec = json.loads(raw)
    except ValueError:
        rec = None
    key = MODEL_SOURCE_METADATA
    if not isinstance(rec, dict) or not all(isinstance(v, str) and v for v in rec.values()):
        return [f"metadata {key!r} is not a JSON object of non-empty strings: {str(raw)[:60]!r}"]
    unknown = sorted(set(rec) - set(MODEL_SOURCE_FIELDS))
    if unknown:
        return [f"metadata {key!r} has unknown field(s) {', '.join(unknown)}"]
    kind = rec.get("kind")
    if kind not in MODEL_SOURCE_KINDS:
        return [f"metadata {key!r} has kind {kind!r}, expected one of {', '.join(MODEL_SOURCE_KINDS)}"]
    needs = {"alias": "alias", "local": "path", "gguf": "path", "hub": "hub_id"}[kind]
    if needs not in rec:
        return [f"metadata {key!r} of kind {kind!r} has no {needs!r}"]
    return []


def layer_group_problems(md: dict[str, str]) -> list[str]:
    """Why ``layer_group_sizes`` is unusable (empty when absent or fine)."""
    raw = md.get(LAYER_GROUPS_METADATA)
    if raw is None:
        return []
    parts = str(raw).split(",")
    if not all(x.strip().isdigit() for x in parts):
        return [f"metadata {LAYER_GROUPS_METADATA!r} is not comma-separated integers: {raw[:60]!r}"]
    sizes, n, d = [int(x) for x in parts], str(md.get("num_layers", "")), str(md.get("head_dim", ""))
    if n.isdigit() and len(sizes) != int(n):
        return [f"metadata {LAYER_GROUPS_METADATA!r} has {len(sizes)} sizes for {n} layers"]
    bad = [g for g in sizes if g <= 0 or g & (g - 1) or (d.isdigit() and int(d) % g)]
    if bad:
        return [f"metadata {LAYER_GROUPS_METADATA!r}: {bad[0]} is not a power of two dividing head_dim {d}"]
    return []


# ----------------------------------------------------------------------------- bytes

_DTYPE_TAG = {"float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
              "int32": "I32", "uint8": "U8", "int8": "I8"}


def dtype_name(t) -> str:
    """``float32`` for a torch or numpy float32 tensor (and so on): the dtype without its library."""
    return str(t.dtype).removeprefix("torch.")


def serialize_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """Canonical safetensors bytes: tensors in name order, header JSON with sorted keys,
    padded with spaces to 8 bytes. Readable by every safetensors reader."""
    import torch

    header: dict = {"__metadata__": {k: str(v) for k, v in sorted(metadata.items())}}
    chunks, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        if dtype_name(t) not in _DTYPE_TAG:
            raise ArtifactError(f"cannot store dtype {t.dtype} for {name}")
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _DTYPE_TAG[dtype_name(t)], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    hjson = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    hjson += b" " * (-len(hjson) % 8)
    return struct.pack("<Q", len(hjson)) + hjson + b"".join(chunks)


# ----------------------------------------------------------------------------- read / write

def has_artifact(directory: Path) -> bool:
    return (Path(directory) / WEIGHTS_NAME).exists()


def write_artifact_files(directory: Path, artifact: Artifact, card: str, report: dict) -> Path:
    """Write the three files of an artifact into an existing ``directory``. All three are written
    under temporary names first and then renamed into place, the safetensors file last, so a kill
    or a full disk while writing leaves the old artifact (or none), never a new card beside old
    tensors or a partial ``oscar.safetensors``."""
    directory = Path(directory)
    atomic_write_files(directory, {
        REPORT_NAME: (json.dumps(report, indent=2, sort_keys=True) + "\n").encode(),
        CARD_NAME: card.encode(),
        WEIGHTS_NAME: serialize_safetensors(artifact.tensors(), artifact.metadata),
    }, last=WEIGHTS_NAME)
    artifact.path = directory
    return directory / WEIGHTS_NAME


def read_metadata(path: Path) -> dict[str, str]:
    """Read only the header of a safetensors file (no tensor data)."""
    path = _weights_path(path)
    try:
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise ArtifactError(f"{path}: truncated safetensors header")
            (n,) = struct.unpack("<Q", raw_len)
            if n > 100_000_000 or n > path.stat().st_size - 8:
                raise ArtifactError(f"{path}: corrupt safetensors header length {n}")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path}: not a readable safetensors file ({e})") from None
    return dict(header.get("__metadata__") or {})


def _weights_path(path: Path) -> Path:
    path = Path(path)
    if path.is_dir():
        path = path / WEIGHTS_NAME
    if not path.exists():
        raise ArtifactError(f"no artifact at {path}")
    return path


def load_artifact(path: Path, *, check: bool = True) -> Artifact:
    """Load an artifact directory (or its ``oscar.safetensors``). With ``check`` (the default) it is
    refused (:class:`ArtifactError`, the first problem) unless it has the contract's structure and
    sound values (finite, orthogonal rotations, clips in (0, 1], ...: :mod:`.values`), so no reader
    ever uses a NaN or a non-orthogonal rotation."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    wpath = _weights_path(path)
    metadata = read_metadata(wpath)
    try:
        tensors = load_file(str(wpath))
    except (SafetensorError, OSError, ValueError) as e:
        raise ArtifactError(f"{wpath}: cannot read tensors ({e})") from None
    if check:
        from .values import value_problems

        problems = check_structure(tensors, metadata)
        problems = problems or value_problems(tensors, metadata)
        if problems:
            raise ArtifactError(f"{wpath}: {problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
    n = int(metadata["num_layers"])
    layers = [LayerRotations(**{k: tensors.get(tensor_name(i, k)) for k in TENSOR_KINDS + SHARED_KINDS})
              for i in range(n)]
    report = {}
    rpath = wpath.parent / REPORT_NAME
    if rpath.exists():
        try:
            report = json.loads(rpath.read_text())
        except ValueError:
            report = {}
    return Artifact(layers=layers, metadata=metadata, path=wpath.parent, report=report)


def check_structure(tensors: dict, metadata: dict[str, str]) -> list[str]:
    """Format-v1 structure checks: metadata keys and types, every tensor present with its shape.
    ``tensors`` may hold torch tensors or numpy arrays (anything with ``shape`` and ``dtype``).
    Returns one message per problem (empty when fine)."""
    problems = []
    if metadata.get("format") != FORMAT_NAME:
        problems.append(f"metadata 'format' is {metadata.get('format')!r}, expected {FORMAT_NAME!r}")
    if metadata.get("format_version") != str(FORMAT_VERSION):
        problems.append(f"unsupported format_version {metadata.get('format_version')!r} (this toolkit reads {FORMAT_VERSION})")
    missing = [k for k in REQUIRED_METADATA if k not in metadata]
    if missing:
        problems.append(f"metadata missing {', '.join(missing)}")
    for k in INT_METADATA:
        if k in metadata and not str(metadata[k]).isdigit():
            problems.append(f"metadata {k!r} is not a non-negative integer: {metadata[k]!r}")
    if problems:
        return problems
    n, h, d = (int(metadata[k]) for k in ("num_layers", "num_kv_heads", "head_dim"))
    kinds = TENSOR_KINDS
    if any(name.endswith(SHARED_KINDS) for name in tensors):      # optional: all of them or none
        kinds = TENSOR_KINDS + SHARED_KINDS
    expected = {tensor_name(i, k): tensor_shape(k, h, d) for i in range(n) for k in kinds}
    for name, shape in expected.items():
        if name not in tensors:
            problems.append(f"missing tensor {name}")
        elif tuple(tensors[name].shape) != shape:
            problems.append(f"{name} has shape {list(tensors[name].shape)}, expected {list(shape)}")
        elif dtype_name(tensors[name]) != "float32":
            problems.append(f"{name} has dtype {dtype_name(tensors[name])}, expected float32")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        problems.append(f"unexpected tensors: {', '.join(extra[:5])}")
    return problems


# ----------------------------------------------------------------------------- artifact vs model

GEOMETRY_KEYS = ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim")


def compatibility_problems(metadata: dict[str, str], geometry, fingerprint: str | None, *,
                           model_name: str = "this model") -> list[str]:
    """Why an artifact (its ``metadata``) does not belong to a model with ``geometry`` (anything with
    ``num_layers``, ``num_attention_heads``, ``num_kv_heads``, ``head_dim``) and ``fingerprint``
    (None: not checked). Empty when it does. The one artifact-matches-model check of the toolkit."""
    problems = []
    for key in GEOMETRY_KEYS:
        have, want = metadata.get(key), getattr(geometry, key)
        if have is not None and str(have) != str(want):
            problems.append(f"{key} is {have} but {model_name} has {want}")
    if fingerprint is not None and metadata.get("model_fingerprint") != fingerprint:
        problems.append(f"model fingerprint {str(metadata.get('model_fingerprint'))[:12]}… does not match "
                        f"{model_name} ({fingerprint[:12]}…): calibrated for another model "
                        f"({metadata.get('model_id')!r}) or config; calibrate this model with `oscar calibrate`")
    return problems


def require_compatible(artifact: "Artifact | dict[str, str]", geometry, fingerprint: str | None, *,
                       model_name: str = "this model") -> None:
    """Raise :class:`ArtifactError` (naming the artifact) unless it belongs to the model."""
    md = artifact.metadata if isinstance(artifact, Artifact) else artifact
    problems = compatibility_problems(md, geometry, fingerprint, model_name=model_name)
    if problems:
        where = getattr(artifact, "path", None) or "the artifact"
        raise ArtifactError(f"{where}: {problems[0]}")
