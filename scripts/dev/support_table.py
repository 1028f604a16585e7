"""Rewrite the support table in docs/reference/models.md from the code that decides each cell
(:mod:`oscar_calib.tools.support`); ``--check`` exits 1 when the page is not what it would write
(what ``tests/tools/test_support_table.py`` checks). About 15 s on 2 CPU cores.

    python scripts/dev/support_table.py            # rewrite the page
    python scripts/dev/support_table.py --check    # exit 1 when it is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "models.md"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when the page is stale; write nothing")
    args = p.parse_args(argv)
    sys.path.insert(0, str(PAGE.parents[2]))
    from oscar_calib.fsutil import atomic_write_text
    from oscar_calib.tools.support import with_table

    page = PAGE.read_text()
    new = with_table(page)
    if args.check:
        if new != page:
            print(f"{PAGE} is stale: run python scripts/dev/support_table.py", file=sys.stderr)
            return 1
        return 0
    if new != page:
        atomic_write_text(PAGE, new)
    print(f"{PAGE}: {'rewritten' if new != page else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
