"""mkdocs hook: the pictures the zoo already has (``zoo/*/*.png``: what ``oscar verify`` and ``oscar eval``
drew for each committed artifact) in the docs site, without a copy in docs/ that could drift.

A page shows one by its path in the repository (``![...](../../zoo/smollm2-135m/verify.png)`` from
``docs/guides/``), which GitHub renders as it is. For the site this hook adds every zoo picture to
the build under ``zoo/`` and points such links there."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

IMAGE = re.compile(r"(!\[[^\]]*\]\()([^)\s]+\.png)(\))")


def zoo_pictures(docs_dir: Path) -> dict[str, Path]:
    """``{site path: file}`` for every picture of the zoo beside ``docs_dir``."""
    zoo = Path(docs_dir).resolve().parent / "zoo"
    return {f"zoo/{p.parent.name}/{p.name}": p for p in sorted(zoo.glob("*/*.png"))}


def site_link(src_uri: str, target: str) -> str | None:
    """A page's (``src_uri``, relative to docs/) link into the repository's zoo, as the site path
    this hook serves it under, relative to the page; None for any other link."""
    where = posixpath.normpath(posixpath.join(posixpath.dirname(src_uri), target))
    if not where.startswith("../zoo/"):
        return None
    return posixpath.relpath(where[len("../"):], posixpath.dirname(src_uri) or ".")


def on_files(files, config):
    from mkdocs.structure.files import File

    for uri, path in zoo_pictures(Path(config["docs_dir"])).items():
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    def swap(m):
        link = site_link(page.file.src_uri, m.group(2))
        return m.group(0) if link is None else m.group(1) + link + m.group(3)

    return IMAGE.sub(swap, markdown)
