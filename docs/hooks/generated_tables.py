"""mkdocs hook: tables generated at build time from the package's own data, so they cannot drift.

A page holds a marker line; the hook replaces it:

==================================  ============================================================
marker                              replaced by
==================================  ============================================================
``<!-- oscar-engine-settings -->``  which artifact settings each export target's engine serves
                                    (the targets' ``serves`` declarations,
                                    ``oscar_calib.contract.features.FEATURES``)
``<!-- oscar-zoo-serving -->``      the exact export commands and launch settings for each zoo
                                    artifact, from real exports (``tools.export.serving_table``)
==================================  ============================================================
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def engine_settings() -> str:
    from oscar_calib.contract.features import FEATURES
    from oscar_calib.tools.export import TARGETS

    head = "| setting | " + " | ".join(f"`{n}`" for n in TARGETS) + " |"
    rows = [head, "|---|" + "---|" * len(TARGETS)]
    for f in FEATURES.values():
        cells = ["serves" if f.name in t.serves else ("refused" if f.refused else "warns") for t in TARGETS.values()]
        rows.append(f"| {f.title} (`{f.name}`) | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def zoo_serving() -> str:
    from oscar_calib.tools.export import serving_table

    lines = []
    for art in sorted(p.parent for p in (ROOT / "zoo").glob("*/oscar.safetensors")):
        rel = art.relative_to(ROOT)
        lines += [f"### {rel}", ""]
        for row in serving_table(art):
            head = f"- **{row['target']}** ({row['checked']})"
            if row.get("refused"):
                lines.append(f"{head}: refused — {row['refused']}")
                continue
            lines += [f"{head}:", "", "  ```", f"  {row['export'].replace('<this directory>', str(rel))}"]
            if row.get("argv"):
                env = " ".join(f"{k}={v}" for k, v in row["env"].items())
                lines.append(f"  serve/{row['target']}/launch.sh   # = {env} {' '.join(row['argv'])}")
            lines += [f"  # {n}" for n in row.get("notes") or [] if not row.get("argv")]
            lines.append("  ```")
            lines += [f"  warning: {w}" for w in row.get("warnings") or []]
        lines.append("")
    return "\n".join(lines)


MARKERS = {"<!-- oscar-engine-settings -->": engine_settings, "<!-- oscar-zoo-serving -->": zoo_serving}


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    for marker, render in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, render())
    return markdown
