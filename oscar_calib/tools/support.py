"""The support table: every model family, what works for it and why not where not, computed from
data rather than written by hand.

For each family of :data:`oscar_calib.model.families.FAMILIES` the cells come from the code that
decides them, asked about the family's tiny stand-in config:

====================  =========================================================================
column                asked
====================  =========================================================================
calibrate             :func:`~oscar_calib.model.geometry.geometry_of` (calibrate, verify and eval
                      need nothing more: they read Q/K/V through transformers' attention interface)
cache                 :func:`~oscar_calib.runtime.compat.cache_slots` (the real ``OscarCache``
                      and the simulation; a hybrid's recurrent-state layers beside them)
decode kernel         the layer kinds: the Triton INT2 decode kernel serves full-attention layers
                      (:func:`~oscar_calib.runtime.attention.kernel_decodes`), sliding-window layers
                      read through the torch path
fold-weights          the registry (:func:`~oscar_calib.model.registry.arch_for`, given the text
                      config: Gemma 4's layers without a value projection)
one per export target :func:`~oscar_calib.tools.export.serving_table` on an artifact of the family's
                      geometry (head_dim 64, per-head and shared rotations, default windows): each
                      target's own refusals, run for real
====================  =========================================================================

and every family the registry refuses (:data:`~oscar_calib.model.registry.UNSUPPORTED`) gets a row
with its reason. :func:`render` writes the Markdown that ``docs/reference/models.md`` holds between
its markers; ``tests/tools/test_support_table.py`` checks that the page is what :func:`render` gives, so
the table cannot drift from the code. ``python scripts/dev/support_table.py`` rewrites the page.
"""

from __future__ import annotations

import functools
import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

START = "<!-- support-table:start -->"
END = "<!-- support-table:end -->"
OK, NO = "✓", "✗"
HEAD_DIM = 64                         # the export columns' artifact geometry (the kernels take 64, 128 or 256)
CORE = ("calibrate", "cache", "decode kernel", "fold-weights")


@dataclass(frozen=True)
class Cell:
    """One cell: whether it works, and why not (or with what qualification)."""

    ok: bool
    note: str = ""


def _cell(fn) -> Cell:
    from ..errors import OscarError

    try:
        note = fn()
    except OscarError as e:
        return Cell(False, str(e))
    return Cell(True, note or "")


def _synthetic_artifact(directory: Path, geo, model_id: str) -> Path:
    """An artifact of ``geo``'s layers, kinds and decoder-layer ids, at head_dim :data:`HEAD_DIM` (a
    model whose layers differ in head_dim keeps their ratios: 64 and 128 for a stand-in's 16 and 32;
    identity rotations, per head and shared, the default windows): what the export targets decide on."""
    import torch

    from .. import FORMAT_VERSION, __version__
    from ..contract.artifact import Artifact, LayerRotations, write_artifact_files
    from ..contract.defaults import DEFAULT_RECENT, DEFAULT_SINK, default_group_size
    from ..contract.layout import FORMAT_NAME, TEXT_CONFIG_METADATA
    from ..contract.settings import ArtifactSettings

    dims = tuple(HEAD_DIM * d // min(geo.head_dims) for d in geo.head_dims)
    layers = []
    for h, d in zip(geo.kv_heads, dims):
        eye, eig = torch.eye(d).expand(h, d, d).clone(), torch.linspace(1, 0, d).expand(h, d).clone()
        layers.append(LayerRotations(eye, eye.clone(), torch.full((h,), 0.96), torch.full((h,), 0.92), eig,
                                     eig.clone(), torch.eye(d), torch.eye(d), eig[0].clone(), eig[0].clone()))
    settings = ArtifactSettings(**(geo.settings_fields() | {"head_dim": dims[0], "layer_head_dims": dims}),
                                group_size=default_group_size(HEAD_DIM), sink_tokens=DEFAULT_SINK,
                                recent_tokens=DEFAULT_RECENT, k_objective="qqt", v_objective="sst",
                                composition="u_h_pbr", shared_clips=(0.96, 0.92), model_type=geo.model_type)
    md = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "model_id": model_id,
          "model_fingerprint": "0" * 64, "calibration": json.dumps({"data": "support table"}),
          "toolkit_version": __version__, **settings.metadata(),
          **({TEXT_CONFIG_METADATA: geo.text_config} if geo.text_config else {})}
    report = {"geometry": {"layer_types": list(geo.layer_types)}}
    write_artifact_files(directory, Artifact(layers=layers, metadata=md, settings=settings), "# support table\n",
                         report)
    return directory


def family_support(family) -> dict[str, Cell]:
    """The cells of one family (see the module docstring), keyed by column."""
    from ..model.geometry import geometry_of, text_config
    from ..model.registry import SINK_MODEL_TYPES, arch_for
    from ..runtime.compat import cache_slots
    from .export import TARGETS, serving_table

    config = family.config()
    cells = {"calibrate": _cell(lambda: None)}
    try:
        geo = geometry_of(config)
    except Exception as e:  # noqa: BLE001 - an OscarError; anything else is a bug the table shows
        cells["calibrate"] = Cell(False, str(e))
        return cells | {c: Cell(False, "not calibrated") for c in (*CORE[1:], *TARGETS)}
    sinks = geo.model_type in SINK_MODEL_TYPES
    notes = []
    if geo.layer_ids is not None:
        notes.append("its attention layers only, mapped to the model's layer ids (layer_ids); the others keep a "
                     "recurrent state")
    if geo.mixed_heads:
        notes.append("each layer with its own head_dim and KV heads (layer_head_dims, layer_kv_heads)")
    cells["calibrate"] = Cell(True, "; ".join(notes))

    def cache():
        slots = cache_slots(config)
        parts = ["with attention sinks"] if sinks else []
        if any(slot.state is not None for slot in slots):
            parts.append("the recurrent states as transformers keeps them; eager decode steps (no CUDA graph)")
        return "; ".join(parts) or None

    cells["cache"] = _cell(cache)

    def kernel():
        kinds = set(geo.layer_types)
        windowed = [n for kind, n in (("sliding_attention", "sliding-window"), ("chunked_attention", "chunked"))
                    if kind in kinds]
        parts = (["with attention sinks"] if sinks else []) + \
            ([f"{' and '.join(windowed)} layers read through the torch path"] if windowed else [])
        if geo.mixed_heads:
            parts.append("layers of a head_dim it does not take (it takes 64, 128 or 256; Gemma 4's global layers "
                         "have 512) read through the torch path")
        return "full-attention layers; " + "; ".join(parts) if parts else None

    cells["decode kernel"] = _cell(kernel) if cells["cache"].ok else Cell(False, "no cache")
    cells["fold-weights"] = _cell(lambda: arch_for(geo.model_type, text_config(config)) and None)
    with tempfile.TemporaryDirectory(prefix=".oscar-support-") as tmp:
        rows = serving_table(_synthetic_artifact(Path(tmp), geo, "the model"))
    for row in rows:
        cells[row["target"]] = Cell(False, row["refused"]) if "refused" in row else Cell(True)
    return cells


def columns() -> tuple[str, ...]:
    from .export import TARGETS

    return (*CORE, *TARGETS)


@functools.lru_cache(maxsize=1)
def table() -> list[tuple[object, dict[str, Cell]]]:
    """``(family, cells)`` for every family of :data:`~oscar_calib.model.families.FAMILIES` (computed
    once per process: the families and the code that decides the cells do not change while it runs)."""
    from ..model.families import FAMILIES

    return [(f, family_support(f)) for f in FAMILIES.values()]


def render() -> str:
    """The Markdown between the page's markers: the table, its numbered notes, the refused families."""
    from ..model.registry import UNSUPPORTED
    from ..runtime.compat import SUPPORTED_TRANSFORMERS

    cols = columns()
    notes: list[str] = []

    def mark(cell: Cell) -> str:
        if not cell.note:
            return OK if cell.ok else NO
        # the stand-ins' layer counts are not the published models': a note says what, not how many
        note = re.sub(r"has \d+ (sliding-window|chunked)", r"has \1", cell.note)
        note = re.sub(r"head geometry \(.*? of \d+\)\)", "head geometry", note)
        note = re.sub(r"^[a-z][a-z0-9_]*: ", "", note)          # the stand-in's model type, which its row names
        note = re.sub(r"the artifact's \d+ layers are the model's attention layers [\d, …]+ \(a hybrid model\)",
                      "the artifact's layers are a hybrid model's attention layers", note)
        if note not in notes:
            notes.append(note)
        return f"{OK if cell.ok else NO} [{notes.index(note) + 1}](#note-{notes.index(note) + 1})"

    low = SUPPORTED_TRANSFORMERS[0].removeprefix(">=")
    lines = ["| family | example | transformers | " + " | ".join(cols) + " |",
             "|" + "---|" * (3 + len(cols))]
    for fam, cells in table():
        name = f"`{fam.name}`" + (" (wrapper)" if fam.wrapper else "")
        lines.append(f"| {name} | {fam.example} | ≥ {fam.since or low} | "
                     + " | ".join(mark(cells[c]) for c in cols) + " |")
    lines += ["", "Notes:", ""]
    lines += [f'{i}. <a id="note-{i}"></a>{n}' for i, n in enumerate(notes, 1)]
    lines += ["", "Refused families (every column ✗):", "", "| model type | why |", "|---|---|"]
    lines += [f"| `{t}` | {why} |" for t, why in UNSUPPORTED.items()]
    return "\n".join(lines) + "\n"


def page_block(page: str) -> str:
    """The generated part of ``page`` (between :data:`START` and :data:`END`)."""
    if START not in page or END not in page:
        raise ValueError(f"the page lost its markers {START} / {END}")
    return page.split(START, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def with_table(page: str) -> str:
    """``page`` with its generated part replaced by :func:`render`."""
    head, rest = page.split(START, 1)
    return f"{head}{START}\n{render()}{END}{rest.split(END, 1)[1]}"
