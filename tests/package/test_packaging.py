"""What pip installs where: triton (no wheels outside Linux) is required on Linux only, every other
dependency everywhere, so the package installs on macOS and Windows and runs the kernels' torch
references there."""

from __future__ import annotations

import sys
from pathlib import Path

from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser as a package
    import tomli as tomllib

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def requirements() -> list[Requirement]:
    return [Requirement(r) for r in tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]]


def test_triton_is_required_on_linux_only():
    triton = next(r for r in requirements() if r.name == "triton")
    for system, sys_platform, wanted in (("Linux", "linux", True), ("Darwin", "darwin", False),
                                         ("Windows", "win32", False)):
        assert triton.marker.evaluate({"platform_system": system, "sys_platform": sys_platform}) is wanted, system


def test_every_other_dependency_installs_everywhere():
    reqs = requirements()
    assert [r.name for r in reqs if r.marker is not None] == ["triton"]
    assert {"torch", "safetensors", "typer"} <= {r.name for r in reqs}


def test_the_ci_step_installs_what_macos_would():
    """`make test-no-triton` installs the list .ci/requirements_for.py prints for Darwin: every
    dependency but triton, and the extras asked for."""
    import subprocess

    script = PYPROJECT.parent / ".ci" / "requirements_for.py"

    def names(*args: str) -> list[str]:
        out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, check=True).stdout
        return [Requirement(line).name for line in out.splitlines()]

    every = [r.name for r in requirements()]
    assert names("--system", "Darwin", "--extra", "dev") == [n for n in every if n != "triton"] + ["pytest", "pytest-xdist"]
    assert names("--system", "Windows") == [n for n in every if n != "triton"]
    assert names("--system", "Linux") == every
