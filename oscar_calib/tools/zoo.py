"""The rotation zoo: artifacts committed under the repository's ``zoo/`` and those pulled into
``$OSCAR_CACHE/zoo/<hf|modelscope>/<ORG>/<NAME>``.

``zoo/index.json`` describes the committed entries; ``oscar zoo index`` regenerates it and
``oscar zoo table`` renders the zoo's markdown tables from it, so the two never disagree. The index is
deterministic (sorted entries, relative paths, no timestamps): regenerating an unchanged zoo
gives a byte-identical file, and ``oscar zoo index --check`` fails when it is stale.

The index also lists the ``upstream`` seed models: OSCAR's own rotations in the Hugging Face repo
``Zhongzhu/OSCAR-RotationZoo``, one per ``configs/*.yaml`` with a ``rotationzoo:`` section, with
their pull recipe (``oscar pull rotationzoo:NAME``, :mod:`oscar_calib.tools.rotationzoo`).

Each entry's figures come from the artifact's own files: the header of ``oscar.safetensors``
(model, geometry, method, its stored content digest), ``calibration.json``'s ``summary`` (held-out
attention error of OSCAR and of the Hadamard baseline), ``verify.json`` (``passed`` and its summary
numbers; ``verification`` says whether it verified the content the artifact holds now:
:mod:`oscar_calib.contract.verification`) and an ``eval`` section (``calibration.json``'s ``eval`` key
or an ``eval.json`` file) when present. An entry whose content no longer matches its digest is
listed with that as its ``error``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..contract import stfile
from ..contract.digest import content_digest, digest_problem
from ..contract.layout import (
    DIGEST_KEY,
    PULL_RECORD,
    REPORT_NAME,
    VERIFY_NAME,
    WEIGHTS_NAME,
    ZOO_INDEX_FORMAT,
    ZOO_INDEX_NAME,
    ZOO_INDEX_VERSION,
    is_zoo_index,
)
from ..contract.verification import verification_of
from ..errors import InputError, OscarError
from ..fsutil import atomic_write_text

EVAL_NAME = "eval.json"
SUMMARY_KEYS = ("mean_attn_error_oscar", "mean_attn_error_hadamard", "layers_better_than_hadamard", "num_layers")


def repo_zoo_dir() -> Path:
    """``$OSCAR_ZOO``, else the ``zoo/`` directory of the source checkout this package runs from,
    else ``./zoo``."""
    env = os.environ.get("OSCAR_ZOO")
    if env:
        return Path(env).expanduser()
    checkout = Path(__file__).resolve().parents[2] / "zoo"
    return checkout if checkout.is_dir() else Path("zoo")


def pull_cache_dir() -> Path:
    from ..model.load import cache_root

    return cache_root() / "zoo"


@dataclass
class ZooEntry:
    """One artifact of the zoo, described from its files without loading its tensors."""

    name: str                   # path relative to the root it was found under
    source: str                 # "zoo" (committed), "hf" / "modelscope" (pulled), or "local"
    path: Path
    model_id: str | None = None
    model_type: str | None = None
    num_layers: int | None = None
    num_attention_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    group_size: int | None = None
    granularity: str | None = None
    composition: str | None = None
    k_objective: str | None = None
    v_objective: str | None = None
    calibration_tokens: int | None = None
    bytes: int = 0
    sha256: str | None = None                        # of the file
    content_sha256: str | None = None                # the stored content digest (None: none, or not matching)
    quality: dict = field(default_factory=dict)      # calibration.json summary
    verified: bool | None = None                     # verify.json passed on this content; None: no verify.json
    verification: str | None = None                  # "yes", "stale", "no"; None: no verify.json
    verify: dict = field(default_factory=dict)       # verify.json's scalar fields
    eval: dict | None = None
    remote: str | None = None                        # hf:ORG/NAME a pulled entry came from
    error: str | None = None

    def to_dict(self, *, relative_to: Path | None = None) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "path"}
        d["path"] = str(self.path.relative_to(relative_to) if relative_to else self.path)
        return d


def _int(v) -> int | None:
    return int(v) if str(v).isdigit() else None


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _scalars(d: dict) -> dict:
    """Top-level scalar fields of a dict, plus those of its ``summary`` sub-dict."""
    out = {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool)) or v is None}
    if isinstance(d.get("summary"), dict):
        out.update({k: v for k, v in d["summary"].items() if isinstance(v, (int, float, str, bool))})
    return out


def describe(directory: Path, *, name: str, source: str, with_hash: bool = False) -> ZooEntry:
    directory = Path(directory)
    wpath = directory / WEIGHTS_NAME
    entry = ZooEntry(name=name, source=source, path=directory)
    try:
        raw = wpath.read_bytes()
        header, data_start = stfile.parse(raw)
    except OSError as e:
        entry.error = f"{wpath}: cannot read ({e.strerror or e})"
        return entry
    except OscarError as e:
        entry.error = f"{wpath}: {e}"
        return entry
    entry.bytes = len(raw)
    md = {str(k): str(v) for k, v in (header.get("__metadata__") or {}).items()}
    digest = content_digest(md, stfile.tensor_entries(raw, header, data_start))
    entry.error = digest_problem(md.get(DIGEST_KEY), digest)
    entry.content_sha256 = md.get(DIGEST_KEY) if entry.error is None else None
    entry.model_id, entry.model_type = md.get("model_id"), md.get("model_type")
    for k in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "group_size"):
        setattr(entry, k, _int(md.get(k)))
    for k in ("granularity", "composition", "k_objective", "v_objective"):
        setattr(entry, k, md.get(k))
    try:
        entry.calibration_tokens = int(json.loads(md.get("calibration", "{}")).get("tokens"))
    except (ValueError, TypeError, AttributeError):
        entry.calibration_tokens = None
    if with_hash:
        entry.sha256 = hashlib.sha256(raw).hexdigest()
    report = _read_json(directory / REPORT_NAME)
    if isinstance(report, dict):
        summary = report.get("summary")
        if isinstance(summary, dict):
            entry.quality = {k: summary[k] for k in SUMMARY_KEYS if k in summary}
        if report.get("eval") is not None:
            entry.eval = report["eval"] if isinstance(report["eval"], dict) else {"value": report["eval"]}
    ev = _read_json(directory / EVAL_NAME)
    if isinstance(ev, dict):
        entry.eval = ev
    verification = verification_of(directory, digest)
    if verification.state != "none":
        entry.verification, entry.verified = verification.state, verification.verified
    ver = _read_json(directory / VERIFY_NAME)
    if isinstance(ver, dict):
        entry.verify = _scalars(ver)
    pulled = _read_json(directory / PULL_RECORD)
    if isinstance(pulled, dict):
        entry.remote = pulled.get("source")
    return entry


def scan(root: Path, *, source: str | None = None, with_hash: bool = False) -> list[ZooEntry]:
    """Every artifact under ``root`` (hidden directories skipped), sorted by name. ``source``
    None means: the first path component (``hf``/``modelscope``) for the pull cache."""
    root = Path(root)
    if not root.is_dir():
        return []
    entries = []
    for w in sorted(root.rglob(WEIGHTS_NAME)):
        rel = w.parent.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not w.is_file():
            continue
        name = rel.as_posix() if rel.parts else root.name
        src = source or (rel.parts[0] if rel.parts else "local")
        entries.append(describe(w.parent, name=name, source=src, with_hash=with_hash))
    return entries


def list_entries(zoo_dir: Path | None = None, *, include_cache: bool = True) -> list[ZooEntry]:
    """Committed entries (``zoo_dir``, default :func:`repo_zoo_dir`) then pulled ones."""
    entries = scan(zoo_dir or repo_zoo_dir(), source="zoo")
    if include_cache:
        entries += scan(pull_cache_dir())
    return entries


# ----------------------------------------------------------------------------- index

def build_index(zoo_dir: Path) -> dict:
    from .rotationzoo import upstream_entries

    zoo_dir = Path(zoo_dir)
    entries = scan(zoo_dir, source="zoo", with_hash=True)
    return {"format": ZOO_INDEX_FORMAT, "format_version": ZOO_INDEX_VERSION,
            "entries": [e.to_dict(relative_to=zoo_dir) for e in entries], "upstream": upstream_entries()}


def render_index(index: dict) -> str:
    return json.dumps(index, indent=2, sort_keys=True) + "\n"


def write_index(zoo_dir: Path) -> tuple[Path, dict]:
    zoo_dir = Path(zoo_dir)
    if not zoo_dir.is_dir():
        raise InputError(f"zoo directory {zoo_dir} does not exist")
    index = build_index(zoo_dir)
    path = zoo_dir / ZOO_INDEX_NAME
    atomic_write_text(path, render_index(index))
    return path, index


def zoo_of(directory: Path) -> Path | None:
    """The zoo an artifact directory belongs to: the nearest directory above it that holds a zoo
    ``index.json`` (``zoo/`` for ``zoo/smollm2-135m``), or None. A command that measures a zoo
    entry writes into it only when told to (``--record``), and then refreshes the index
    (:func:`refresh_index`), so the index never goes stale behind the user's back."""
    for parent in Path(directory).absolute().parents:
        if is_zoo_index(parent / ZOO_INDEX_NAME):
            return parent
    return None


def zoo_display(root: Path) -> str:
    """A zoo directory as a person reads it: relative to the working directory when below it."""
    try:
        return str(Path(root).relative_to(Path.cwd())) or "."
    except ValueError:
        return str(root)


def refresh_index(directory: Path) -> Path | None:
    """After a write into an artifact: when it belongs to a zoo (:func:`zoo_of`) whose index no
    longer describes it, regenerate that index and return its path; otherwise return None."""
    root = zoo_of(directory)
    if root is None or index_is_current(root):
        return None
    return Path(zoo_display(write_index(root)[0]))


def index_is_current(zoo_dir: Path) -> bool:
    path = Path(zoo_dir) / ZOO_INDEX_NAME
    try:
        return path.read_text() == render_index(build_index(zoo_dir))
    except OSError:
        return False


def load_index(zoo_dir: Path) -> dict:
    path = Path(zoo_dir) / ZOO_INDEX_NAME
    doc = _read_json(path)
    if not isinstance(doc, dict) or doc.get("format") != ZOO_INDEX_FORMAT or not isinstance(doc.get("entries"), list):
        raise InputError(f"{path}: missing or not an oscar zoo index; run `oscar zoo index`")
    return doc


def _fmt(x, digits: int = 4) -> str:
    return f"{x:.{digits}f}" if isinstance(x, float) else ("–" if x is None else str(x))


def eval_text(ev: dict | None) -> str:
    if not ev:
        return "–"
    ppl = [(label, ev[f"{m}_ppl"]) for m, label in (("bf16", "BF16"), ("hadamard", "Hadamard"), ("oscar", "OSCAR"),
                                                    ("fork", "fork"))
           if isinstance(ev.get(f"{m}_ppl"), (int, float))]
    if ppl:                                          # the headline numbers of ``oscar eval --record``
        out = "ppl " + " / ".join(f"{label} {v:.2f}" for label, v in ppl)
        niah = ev.get("niah")
        if isinstance(niah, dict) and isinstance(niah.get("oscar"), (int, float)):
            out += f"; NIAH OSCAR {niah['oscar']:.0%}"
        return out
    parts = [f"{k} {_fmt(v, 3)}" for k, v in ev.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return ", ".join(parts[:4]) or "see artifact"


def markdown_table(index: dict) -> str:
    """The zoo's markdown table, generated from ``index.json``."""
    entries = index.get("entries", [])
    if not entries:
        return "_The zoo is empty: no artifacts are committed yet._\n"
    lines = ["| artifact | base model | layers × KV heads × head_dim | method | attn error OSCAR / Hadamard "
             "| verified | eval |", "|---|---|---|---|---|---|---|"]
    for e in entries:
        q = e.get("quality") or {}
        err = (f"{_fmt(q.get('mean_attn_error_oscar'))} / {_fmt(q.get('mean_attn_error_hadamard'))}"
               if q else "–")
        verified = {"yes": "yes", "stale": "**stale**", "no": "**no**"}.get(e.get("verification"), "–")
        geometry = f"{_fmt(e.get('num_layers'))} × {_fmt(e.get('num_kv_heads'))} × {_fmt(e.get('head_dim'))}"
        method = f"{e.get('composition')}, {e.get('granularity')}"
        lines.append(f"| [`{e['name']}`](zoo/{e['path']}) | `{e.get('model_id')}` | {geometry} | {method} | {err} "
                     f"| {verified} | {eval_text(e.get('eval'))} |")
    return "\n".join(lines) + "\n"


def upstream_table(index: dict) -> str:
    """The markdown table of upstream seed models (OSCAR's RotationZoo) and their pull recipe."""
    ups = index.get("upstream") or []
    if not ups:
        return ""
    lines = ["| base model | layers × KV heads × head_dim | RotationZoo tag | clips K / V | group, BF16 sink + recent "
             "| pull |", "|---|---|---|---|---|---|"]
    for u in ups:
        geometry = " × ".join(str(x) for x in u["geometry"])
        lines.append(f"| `{u['model_id']}` | {geometry} | `{u['tag'] or '–'}` | {u['k_clip']:g} / {u['v_clip']:g} | "
                     f"{u['group_size']}, {u['sink']} + {u['recent']} | `{u['pull']}` |")
    return "\n".join(lines) + "\n"
