#!/usr/bin/env python3
"""Print pyproject.toml's requirements as pip resolves them on another operating system: the
dependencies and the named extras, each environment marker evaluated for ``--system`` (Darwin,
Windows, Linux), one requirement a line, markers dropped.

    python .ci/requirements_for.py --system Darwin --extra dev > requirements.txt

``make test-no-triton`` installs this list for Darwin (where triton has no wheel) to check the
package installs and runs without triton.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser as a package
    import tomli as tomllib

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
SYSTEMS = {"Darwin": ("darwin", "posix"), "Windows": ("win32", "nt"), "Linux": ("linux", "posix")}


def requirements_for(system: str, extras: list[str], pyproject: Path = PYPROJECT) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    sys_platform, os_name = SYSTEMS[system]
    out = []
    for group, reqs in [("", project["dependencies"])] + [(e, project["optional-dependencies"][e]) for e in extras]:
        for text in reqs:
            req = Requirement(text)
            env = {"platform_system": system, "sys_platform": sys_platform, "os_name": os_name, "extra": group}
            if req.marker is None or req.marker.evaluate(env):
                req.marker = None
                out.append(str(req))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system", choices=sorted(SYSTEMS), required=True)
    ap.add_argument("--extra", action="append", default=[], help="an optional-dependency group (repeatable)")
    args = ap.parse_args()
    print("\n".join(requirements_for(args.system, args.extra)))


if __name__ == "__main__":
    main()
