"""mkdocs hook: the command-line reference page, generated at build time by Typer's own documentation
generator (`typer oscar_calib.cli utils docs`) from the `oscar` application, so it cannot drift from
`--help`. The page `reference/cli.md` holds the marker line; the generated sections replace it, one
heading level down so they sit under the page's title. The generator lists each group's commands
with click's short help, cut at 45 characters ("Check artifacts against the format-v1..."); the
lists here give each command's first sentence whole."""

from __future__ import annotations

import re
import subprocess
import sys

PAGE = "reference/cli.md"
MARKER = "<!-- oscar-cli-reference -->"


def _generated() -> str:
    cmd = [sys.executable, "-m", "typer", "oscar_calib.cli", "utils", "docs", "--name", "oscar"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[1:])} failed: {done.stderr.strip()[-2000:]}")
    summaries = _summaries()
    lines, fenced, group = [], False, ""
    for line in done.stdout.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = re.match(r"#+ `oscar ?(.*)`$", line) if not fenced else None
        if heading:
            group = heading[1]
        item = re.match(r"\* `([\w-]+)`: ", line) if not fenced else None
        if item and f"{group} {item[1]}".strip() in summaries:
            line = f"* `{item[1]}`: {summaries[f'{group} {item[1]}'.strip()]}"
        lines.append("#" + line if line.startswith("#") and not fenced else line)
    return "\n".join(lines) + "\n"


def _summaries() -> dict[str, str]:
    """``{"zoo list": first paragraph of its help, ...}`` for every command of the `oscar` app."""
    import typer.main

    from oscar_calib.cli import app

    out = {}

    def walk(group, prefix: str) -> None:
        for name, cmd in getattr(group, "commands", {}).items():
            path = f"{prefix} {name}".strip()
            paragraph = " ".join((cmd.help or "").strip().split("\n\n")[0].split())
            out[path] = re.split(r"(?<=\.) (?=[A-Z`])", paragraph)[0]        # its first sentence, whole
            walk(cmd, path)

    walk(typer.main.get_command(app), "")
    return out


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise RuntimeError(f"{PAGE} lost its marker line {MARKER}")
    return markdown.replace(MARKER, _generated())
