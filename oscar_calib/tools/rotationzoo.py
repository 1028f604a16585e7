"""``oscar pull rotationzoo:NAME``: OSCAR's own published rotations (the Hugging Face repository
``Zhongzhu/OSCAR-RotationZoo``) as a validated format-v1 artifact.

``NAME`` is a ``configs/*.yaml`` name (``qwen3-8b``) or its model id (``Qwen/Qwen3-8B``); the file's
``rotationzoo:`` section (:class:`~oscar_calib.model.configs.RotationZooSpec`) says where to look
and how the fork's scripts serve the model (clips, group size, windows).

The repository's layout could not be verified from here, so none is hard-coded. The file list
(``list_repo_files``) is searched for directories holding a K and a V rotation file
(``k_rotation_*.pt`` / ``v_rotation_*.pt``; when a directory holds several, the per-KV-head
``k_rotation_perhead.pt`` / ``v_rotation_perhead.pt`` are preferred, then the fork's defaults
``k_rotation_qqt_r_h_pbr.pt`` / ``v_rotation_sst_r_h_pbr.pt``) whose path has a component naming
the model (any of the config's ``names``, else the model id's name; compared ignoring case, ``-``,
``_`` and ``.``). A component ``seq<T>_prompt<N>_group<G>`` is the calibration tag (T calibration
tokens, N prompts, INT2 group size G). Of several candidates the one ``--tag`` names is taken (a
tag, or any part of the directory path), else the config's pinned tag, else the only one; anything
else is one clear error listing what the repository holds for the model.

The pair is imported with :func:`~oscar_calib.tools.export.import_files` (``torch.load(weights_only=
True)`` only; every file SGLang loads is accepted: V1 ``[d, d]`` per layer, or V2 ``[h, d, d]``, the
Hub's per-head ``k_rotation_perhead.pt`` / ``v_rotation_perhead.pt``), for:

* ``--model M`` given: the fingerprint of M's ``config.json`` (a model built on the meta device; no
  weights are read, a hub id fetches only its config), so the artifact matches that model;
* otherwise the ``configs/`` geometry: fingerprint of a meta-device model built from it, recorded in
  the card as such (``oscar eval``/``verify`` on the real weights then report a fingerprint mismatch:
  pull again with ``--model``).

Group size: the tag's G (else the config's); clips, sink and recent: the config's (``--clip``
overrides the clips). The card and ``calibration.json`` record the repository, revision, directory,
file paths, tag (parsed) and clips; ``.oscar-pull.json`` records the source for ``oscar zoo list``.
Default destination: ``$OSCAR_CACHE/zoo/rotationzoo/NAME``.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..errors import InputError, OscarError, PublishError
from ..fsutil import atomic_write_text

PREFIX = "rotationzoo:"
TAG = re.compile(r"seq(\d+)_prompt(\d+)_group(\d+)")
# preferred file names, best first: the Hub's per-KV-head V2 files (its Qwen3-30B-A3B/ layout), then the
# fork's default V1 pair
PREFERRED = (("k_rotation_perhead.pt", "k_rotation_qqt_r_h_pbr.pt"),
             ("v_rotation_perhead.pt", "v_rotation_sst_r_h_pbr.pt"))


# the hub, in two functions (tests replace them)
def list_repo_files(repo_id: str, revision: str | None) -> list[str]:
    from huggingface_hub import HfApi

    from .hub import require_online

    require_online("hf")           # without a network: one line in seconds, not the client's retries
    return list(HfApi().list_repo_files(repo_id, repo_type="model", revision=revision))


def download_file(repo_id: str, filename: str, revision: str | None, local_dir: Path) -> Path:
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo_id, filename, repo_type="model", revision=revision, local_dir=str(local_dir)))


@dataclass
class ZooPair:
    """One directory of the repository holding a K and a V rotation file."""

    directory: str
    k_files: list[str]
    v_files: list[str]
    tag: str | None = None

    @property
    def tag_fields(self) -> dict | None:
        return parse_tag(self.tag)

    def files(self) -> tuple[str, str]:
        """The K and V paths: the per-head V2 pair, else the fork's default V1 names, else the only
        file of each kind."""
        picked = []
        for files, preferred in ((self.k_files, PREFERRED[0]), (self.v_files, PREFERRED[1])):
            names = {PurePosixPath(f).name: f for f in files}
            hit = next((names[p] for p in preferred if p in names), None)
            if hit is None and len(files) == 1:
                hit = files[0]
            if hit is None:
                raise InputError(f"{self.directory} holds several rotation files ({', '.join(sorted(names))}) and "
                                 f"none is {' or '.join(preferred)}; import the pair you want with `oscar import K.pt "
                                 "V.pt`")
            picked.append(hit)
        return picked[0], picked[1]


def parse_tag(tag: str | None) -> dict | None:
    """``seq<T>_prompt<N>_group<G>`` -> ``{"tokens": T, "prompts": N, "group_size": G}`` (None if not one)."""
    m = TAG.fullmatch(tag or "")
    return {"tokens": int(m[1]), "prompts": int(m[2]), "group_size": int(m[3])} if m else None


def _norm(name: str) -> str:
    return re.sub(r"[-_.]", "", name.lower())


def rotation_pairs(files: list[str]) -> list[ZooPair]:
    """Every directory of ``files`` (repository paths) holding ``k_rotation_*.pt`` and ``v_rotation_*.pt``."""
    dirs: dict[str, tuple[list[str], list[str]]] = {}
    for f in files:
        p = PurePosixPath(f)
        for i, prefix in enumerate(("k_rotation_", "v_rotation_")):
            if p.name.startswith(prefix) and p.suffix == ".pt":
                dirs.setdefault(str(p.parent), ([], []))[i].append(f)
    pairs = []
    for d, (ks, vs) in sorted(dirs.items()):
        if ks and vs:
            tag = next((part for part in PurePosixPath(d).parts if TAG.fullmatch(part)), None)
            pairs.append(ZooPair(d, sorted(ks), sorted(vs), tag))
    return pairs


def model_pairs(pairs: list[ZooPair], names: list[str]) -> list[ZooPair]:
    wanted = {_norm(n) for n in names}
    return [p for p in pairs if any(_norm(part) in wanted for part in PurePosixPath(p.directory).parts)]


def choose_pair(pairs: list[ZooPair], *, tag: str | None, pinned: str | None, what: str) -> ZooPair:
    """The pair ``tag`` names (a tag, or part of the directory path), else the ``pinned`` tag's,
    else the only one; otherwise one :class:`InputError` listing the candidates."""
    listing = "; ".join(p.directory for p in pairs)
    if tag:
        hits = [p for p in pairs if p.tag == tag or tag.strip("/") in p.directory]
        if len(hits) == 1:
            return hits[0]
        raise InputError(f"--tag {tag!r} matches {len(hits)} of the rotation directories for {what}: {listing}")
    if len(pairs) == 1:
        return pairs[0]
    hits = [p for p in pairs if pinned and p.tag == pinned]
    if len(hits) == 1:
        return hits[0]
    raise InputError(f"{len(pairs)} rotation directories for {what} ({listing}); choose one with --tag")


@dataclass
class ZooPull:
    """What ``oscar pull rotationzoo:NAME`` did."""

    name: str
    out: Path
    source: dict
    result: object = None                # the ImportResult
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"source": f"{PREFIX}{self.name}", "path": str(self.out), **self.source,
                "granularity": self.result.artifact.metadata["granularity"] if self.result else None}


def find_config(name: str):
    """The ``configs/*.yaml`` with a ``rotationzoo:`` section that ``name`` names (file name or model id)."""
    from ..model.configs import load_all

    known = [c for c in load_all() if c.rotationzoo is not None]
    for c in known:
        if name.lower() in (c.name.lower(), c.geometry.model_id.lower()):
            return c
    raise InputError(f"no RotationZoo recipe for {name!r}; known: {', '.join(c.name for c in known)} "
                     "(configs/*.yaml with a rotationzoo: section)")


def _target(cfg, model: str | None, trust_remote_code: bool):
    """The :class:`ModelTarget` the artifact records: ``model``'s config.json, else configs/ geometry."""
    from ..model.geometry import config_fingerprint, geometry_of
    from .export import ModelTarget

    if model is None:
        g = cfg.geometry
        return ModelTarget.from_geometry(g.model_id, g.to_geometry(), config_fingerprint(g.to_hf_config()),
                                         note=f"fingerprint from configs/{cfg.name}.yaml geometry, not the model's own "
                                              "config: pull with --model to match a checkpoint")
    from transformers import AutoConfig

    from ..model.load import load_model
    from ..model.source import ALIASES, resolve_model

    if model in ALIASES or resolve_model(model).gguf_file:
        return ModelTarget.from_loaded(load_model(model, device="cpu"))
    try:
        config = AutoConfig.from_pretrained(resolve_model(model).path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read the config of {model!r}: {str(e).strip().splitlines()[0]}") from None
    return ModelTarget.from_geometry(resolve_model(model).model_id, geometry_of(config), config_fingerprint(config),
                                     note=f"fingerprint from the config.json of {model} (no weights read)")


def pull_rotationzoo(spec: str, *, out: Path | None = None, tag: str | None = None, model: str | None = None,
                     revision: str | None = None, clip=(None, None), overwrite: bool = False,
                     trust_remote_code: bool = False) -> ZooPull:
    """Fetch a model's K/V pair from OSCAR's RotationZoo and import it (module docstring)."""
    from ..contract.layout import PULL_RECORD
    from ..model.load import cache_root

    name = spec[len(PREFIX):] if spec.startswith(PREFIX) else spec
    cfg = find_config(name)
    rz = cfg.rotationzoo
    try:
        files = list_repo_files(rz.repo, revision)
    except OscarError:
        raise
    except Exception as e:  # noqa: BLE001 - the hub client raises many types; one line for the user
        raise PublishError(f"cannot list hf:{rz.repo} (no network, no such repository or revision?): "
                           f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
    names = list(rz.names) or [cfg.geometry.model_id.split("/")[-1]]
    pairs = model_pairs(rotation_pairs(files), names)
    if not pairs:
        dirs = sorted({p.directory for p in rotation_pairs(files)})
        raise InputError(f"hf:{rz.repo} has no K/V rotation files under a directory named {' or '.join(names)}; "
                         f"it holds {len(dirs)} rotation directories{': ' + '; '.join(dirs[:12]) if dirs else ''}")
    pair = choose_pair(pairs, tag=tag, pinned=rz.tag, what=cfg.geometry.model_id)
    k_file, v_file = pair.files()
    target = _target(cfg, model, trust_remote_code)
    fields = pair.tag_fields
    group = fields["group_size"] if fields else rz.group_size
    clips = (rz.k_clip if clip[0] is None else clip[0], rz.v_clip if clip[1] is None else clip[1])
    source = {"repository": f"hf:{rz.repo}", "revision": revision or "main", "directory": pair.directory,
              "k_file": k_file, "v_file": v_file, "calibration_tag": pair.tag or "none",
              **({f"tag_{k}": v for k, v in fields.items()} if fields else {}),
              "clips": f"k={clips[0]:g}, v={clips[1]:g} (configs/{cfg.name}.yaml: the fork's scripts)"}
    out = Path(out) if out is not None else cache_root() / "zoo" / "rotationzoo" / cfg.name
    with tempfile.TemporaryDirectory(prefix=".oscar-rotationzoo-") as tmp:
        try:
            k_path = download_file(rz.repo, k_file, revision, Path(tmp))
            v_path = download_file(rz.repo, v_file, revision, Path(tmp))
        except OscarError:
            raise
        except Exception as e:  # noqa: BLE001
            raise PublishError(f"cannot download {k_file} / {v_file} from hf:{rz.repo}: "
                               f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
        from .export import import_files  # torch: only once the hub has answered

        result = import_files("sglang-fork", [k_path, v_path], target, out, clip=clips, group_size=group, sink_tokens=rz.sink,
                               recent_tokens=rz.recent, overwrite=overwrite or _in_cache(out), source=source)
    record = {"source": f"{PREFIX}{cfg.name}", "repository": f"hf:{rz.repo}", "revision": revision,
              "directory": pair.directory, "tag": pair.tag, "pulled_at": int(time.time())}
    atomic_write_text(out / PULL_RECORD, json.dumps(record, indent=2, sort_keys=True) + "\n")
    return ZooPull(cfg.name, out, source, result)


def _in_cache(out: Path) -> bool:
    """A pull into the zoo cache replaces the cached copy (like ``oscar pull hf:...``)."""
    from ..model.load import cache_root

    return Path(out).resolve().is_relative_to((cache_root() / "zoo").resolve())


def upstream_entries() -> list[dict]:
    """The seed models of the upstream RotationZoo, from ``configs/`` (for the zoo index and list)."""
    from ..model.configs import load_all

    out = []
    for c in load_all():
        rz = c.rotationzoo
        if rz is None:
            continue
        g = c.geometry
        out.append({"name": c.name, "model_id": g.model_id, "repository": f"hf:{rz.repo}", "tag": rz.tag,
                    "k_clip": rz.k_clip, "v_clip": rz.v_clip, "group_size": rz.group_size, "sink": rz.sink,
                    "recent": rz.recent, "geometry": [g.num_layers, g.num_kv_heads, g.head_dim],
                    "config": f"configs/{c.name}.yaml", "pull": f"oscar pull {PREFIX}{c.name}"})
    return out
