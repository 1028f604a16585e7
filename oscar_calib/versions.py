"""Version strings of the libraries we run with, as comparable ``(major, minor)`` tuples."""

from __future__ import annotations


def version_tuple(version: str) -> tuple[int, int]:
    """``"5.17.0.dev0"`` -> ``(5, 17)``: the leading digits of the first two parts (a part without
    leading digits counts 0, a missing minor too), so local and pre-release tags do not matter."""
    parts = []
    for p in version.split(".")[:2]:
        digits = ""
        for ch in p:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits or 0))
    while len(parts) < 2:
        parts.append(0)
    return parts[0], parts[1]
