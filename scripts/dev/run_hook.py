"""Run one hook of ``.pre-commit-hooks.yaml`` the way ``pre-commit run --all-files`` would, offline.

pre-commit builds a fresh environment for a ``language: python`` hook (``pip install .``), which
needs the network; CI and the tests already have the toolkit installed, so this runs the hook's
own ``entry`` and ``args`` on the files below DIR... that its ``files``/``exclude`` patterns
match (hidden directories skipped, paths relative to the working directory, sorted), with the
same interpreter: a leading ``oscar`` becomes ``python -m oscar_calib``. Exit code: the hook's.

    python scripts/dev/run_hook.py oscar-validate zoo
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

MANIFEST = Path(__file__).resolve().parents[2] / ".pre-commit-hooks.yaml"


def load_hook(hook_id: str, manifest: Path = MANIFEST) -> dict:
    hooks = yaml.safe_load(manifest.read_text())
    for hook in hooks:
        if hook["id"] == hook_id:
            return hook
    raise SystemExit(f"error: no hook {hook_id!r} in {manifest} (have: {', '.join(h['id'] for h in hooks)})")


def matching_files(hook: dict, dirs: list[Path]) -> list[str]:
    """Files below ``dirs`` that the hook's ``files`` pattern matches and ``exclude`` does not
    (both searched in the path, as pre-commit does)."""
    include = re.compile(hook.get("files", ""))
    exclude = re.compile(hook.get("exclude", "^$"))
    out = set()
    for d in dirs:
        for root, subdirs, files in os.walk(d):
            subdirs[:] = sorted(s for s in subdirs if not s.startswith("."))
            for name in files:
                path = Path(os.path.relpath(Path(root) / name)).as_posix()
                if include.search(path) and not exclude.search(path):
                    out.add(path)
    return sorted(out)


def hook_command(hook: dict, files: list[str]) -> list[str]:
    argv = shlex.split(hook["entry"]) + [str(a) for a in hook.get("args", [])]
    if argv[0] == "oscar":
        argv = [sys.executable, "-m", "oscar_calib", *argv[1:]]
    return argv + (files if hook.get("pass_filenames", True) else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hook_id")
    parser.add_argument("dirs", nargs="*", type=Path, default=[Path(".")])
    args = parser.parse_args(argv)
    hook = load_hook(args.hook_id)
    files = matching_files(hook, args.dirs)
    if not files:
        print(f"{hook['name']}: no files to check (skipped)")
        return 0
    print(f"{hook['name']}: {len(files)} file(s)", flush=True)
    return subprocess.run(hook_command(hook, files)).returncode


if __name__ == "__main__":
    sys.exit(main())
