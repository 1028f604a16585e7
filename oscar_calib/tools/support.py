"""The support table: every model family, what works for it and why not where not, computed from
data rather than written by hand.

For each family of :data:`oscar_calib.model.families.FAMILIES` the cells come from the code that
decides them, asked about the family's tiny stand-in config:

====================  =========================================================================
column                asked
====================  =========================================================================
calibrate             :func:`~oscar_calib.model.geometry.geometry_of` (calibrate, verify and eval
                      need nothing more: they read Q/K/V through transformers' attention interface)
cache                 :func:`~oscar_calib.runtime.compat.layer_windows` (the real ``OscarCache``
                      and the simulation)
decode kernel         the layer kinds: the Triton INT2 decode kernel serves full-attention layers
                      (:func:`~oscar_calib.runtime.attention.kernel_decodes`), sliding-window layers
                      read through the torch path
fold-weights          the registry (:func:`~oscar_calib.model.registry.arch_for`)
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
    """An artifact of ``geo``'s layers and kinds at head_dim :data:`HEAD_DIM` (identity rotations,
    per head and shared, the default windows): what the export targets decide on."""
    import torch

    from .. import FORMAT_VERSION, __version__
    from ..contract.artifact import Artifact, LayerRotations, write_artifact_files
    from ..contract.defaults import DEFAULT_RECENT, DEFAULT_SINK, default_group_size
    from ..contract.layout import (
        FORMAT_NAME,
        SHARED_CLIP_METADATA,
        TEXT_CONFIG_METADATA,
    )

    h, d = geo.num_kv_heads, HEAD_DIM
    eye, eig = torch.eye(d).expand(h, d, d).clone(), torch.linspace(1, 0, d).expand(h, d).clone()
    layers = [LayerRotations(eye, eye.clone(), torch.full((h,), 0.96), torch.full((h,), 0.92), eig, eig.clone(),
                             torch.eye(d), torch.eye(d), eig[0].clone(), eig[0].clone())
              for _ in range(geo.num_layers)]
    md = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "model_id": model_id,
          "model_fingerprint": "0" * 64, "num_layers": str(geo.num_layers),
          "num_attention_heads": str(geo.num_attention_heads), "num_kv_heads": str(h), "head_dim": str(d),
          "group_size": str(default_group_size(d)), "bits": "2", "sink_tokens": str(DEFAULT_SINK),
          "recent_tokens": str(DEFAULT_RECENT), "k_objective": "qqt", "v_objective": "sst", "composition": "u_h_pbr",
          "granularity": "head", "calibration": json.dumps({"data": "support table"}), "toolkit_version": __version__,
          "model_type": geo.model_type, **dict(zip(SHARED_CLIP_METADATA, ("0.96", "0.92"))),
          **({TEXT_CONFIG_METADATA: geo.text_config} if geo.text_config else {})}
    report = {"geometry": {"layer_types": list(geo.layer_types)}}
    write_artifact_files(directory, Artifact(layers=layers, metadata=md), "# support table\n", report)
    return directory


def family_support(family) -> dict[str, Cell]:
    """The cells of one family (see the module docstring), keyed by column."""
    from ..model.geometry import geometry_of
    from ..model.registry import SINK_MODEL_TYPES, arch_for
    from ..runtime.compat import layer_windows
    from .export import TARGETS, serving_table

    config = family.config()
    cells = {"calibrate": _cell(lambda: None)}
    try:
        geo = geometry_of(config)
    except Exception as e:  # noqa: BLE001 - an OscarError; anything else is a bug the table shows
        cells["calibrate"] = Cell(False, str(e))
        return cells | {c: Cell(False, "not calibrated") for c in (*CORE[1:], *TARGETS)}
    sinks = geo.model_type in SINK_MODEL_TYPES
    cells["cache"] = _cell(lambda: layer_windows(config) and ("with attention sinks" if sinks else None))

    def kernel():
        kinds = set(geo.layer_types)
        windowed = [n for kind, n in (("sliding_attention", "sliding-window"), ("chunked_attention", "chunked"))
                    if kind in kinds]
        parts = (["with attention sinks"] if sinks else []) + \
            ([f"{' and '.join(windowed)} layers read through the torch path"] if windowed else [])
        return "full-attention layers; " + "; ".join(parts) if parts else None

    cells["decode kernel"] = _cell(kernel) if cells["cache"].ok else Cell(False, "no cache")
    cells["fold-weights"] = _cell(lambda: arch_for(geo.model_type) and None)
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
