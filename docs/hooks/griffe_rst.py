"""griffe extension for the API pages: the package's docstrings use a few reStructuredText forms
(cross-reference roles, simple tables, section underlines, ``::`` literal blocks) that Markdown
renders as raw text. This rewrites them into their Markdown equivalents before mkdocstrings renders
the docstrings; the source files are not touched."""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj|const):`(~?)\.?([^`]+)`")
BORDER = re.compile(r"^\s*=+(\s+=+)+\s*$")
UNDERLINE = re.compile(r"^\s*([-=~^])\1{2,}\s*$")


def _role(m: re.Match) -> str:
    name = m.group(2)
    return f"`{name.rsplit('.', 1)[-1] if m.group(1) else name}`"


def _columns(border: str) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for m in re.finditer(r"=+", border)]


def _cells(line: str, cols: list[tuple[int, int]]) -> list[str]:
    out = []
    for i, (start, end) in enumerate(cols):
        stop = cols[i + 1][0] if i + 1 < len(cols) else len(line)
        out.append(line[start:stop].strip())
    return out


def _table(lines: list[str]) -> list[str]:
    """A reStructuredText simple table (border, header, border, rows, border) as a Markdown table;
    a row whose first cell is empty continues the row above."""
    cols = _columns(lines[0])
    borders = [i for i, line in enumerate(lines) if BORDER.match(line)]
    header = [" ".join(c) for c in zip(*(_cells(x, cols) for x in lines[borders[0] + 1:borders[1]]))]
    rows: list[list[str]] = []
    for line in lines[borders[1] + 1:borders[-1]]:
        if not line.strip():
            continue
        cells = _cells(line, cols)
        if rows and (not cells[0] or not any(cells[1:])):
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells)]
        else:
            rows.append(cells)
    md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return ["", *md, ""]


def to_markdown(text: str) -> str:
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if BORDER.match(line):
            j, borders = i, 0
            while j < len(lines) and borders < 3:
                borders += bool(BORDER.match(lines[j]))
                j += 1
            if borders == 3:
                out += _table(lines[i:j])
                i = j
                continue
        if i + 1 < len(lines) and line.strip() and UNDERLINE.match(lines[i + 1]) \
                and len(lines[i + 1].strip()) >= len(line.strip()):
            out += [f"**{line.strip()}**", ""]
            i += 2
            continue
        out.append(line[:-2] + ":" if line.endswith("::") and not line.strip() == "::" else line)
        i += 1
    return ROLE.sub(_role, "\n".join(out))


class RstToMarkdown(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
