"""mkdocs hook: the command-line reference page, generated at build time by Typer's own documentation
generator (`typer oscar_calib.cli utils docs`) from the `oscar` application, so it cannot drift from
`--help`. The page `reference/cli.md` holds the marker line; the generated sections replace it, one
heading level down so they sit under the page's title."""

from __future__ import annotations

import subprocess
import sys

PAGE = "reference/cli.md"
MARKER = "<!-- oscar-cli-reference -->"


def _generated() -> str:
    cmd = [sys.executable, "-m", "typer", "oscar_calib.cli", "utils", "docs", "--name", "oscar"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[1:])} failed: {done.stderr.strip()[-2000:]}")
    lines, fenced = [], False
    for line in done.stdout.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        lines.append("#" + line if line.startswith("#") and not fenced else line)
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise RuntimeError(f"{PAGE} lost its marker line {MARKER}")
    return markdown.replace(MARKER, _generated())
