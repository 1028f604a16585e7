"""Big-model placement with accelerate: ``--device-map``, ``--max-memory``, ``--offload-dir``.

``--device-map auto`` (or ``balanced``, ``sequential``, a JSON dict) and ``--max-memory
0=70GiB,cpu=200GiB`` go to ``from_pretrained``, i.e. accelerate's big-model dispatch: layers spread
over GPUs, CPU RAM and disk (safetensors checkpoints are disk-offloaded in place, read from their own
files). Under data parallelism each rank gets its own slice of the GPUs
(:func:`oscar_calib.jobs.session.placement_for_rank`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InputError

if TYPE_CHECKING:
    import torch


@dataclass
class Placement:
    """Big-model loading: accelerate's ``device_map``, ``max_memory`` and ``offload_dir`` (the
    folder for weights offloaded to disk) for ``from_pretrained``."""

    device_map: str | dict | None = None
    max_memory: dict | None = None
    offload_dir: str | None = None


def cpu_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.9)
    except (ValueError, OSError, AttributeError):
        return 64 * 2**30


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)


def parse_max_memory(text: str | None) -> dict | None:
    """``"0=70GiB,cpu=200GiB"`` -> ``{0: "70GiB", "cpu": "200GiB"}`` (keys: GPU index, ``cuda:N``,
    ``cpu``, ``disk``, ``mps``; values: a size with a unit, or bytes)."""
    if text is None or not text.strip():
        return None
    out: dict = {}
    for part in text.split(","):
        key, sep, val = part.partition("=")
        key, val = key.strip().lower(), val.strip()
        if not sep or not key or not val:
            raise InputError(f"--max-memory expects DEVICE=SIZE[,DEVICE=SIZE...], e.g. 0=70GiB,cpu=200GiB; got {text!r}")
        if key.startswith("cuda:"):
            key = key[5:]
        if key.isdigit():
            k: int | str = int(key)
        elif key in ("cpu", "disk", "mps"):
            k = key
        else:
            raise InputError(f"--max-memory: unknown device {key!r} (use a GPU index, cpu, disk or mps)")
        m = _SIZE.match(val)
        if not m:
            raise InputError(f"--max-memory: {val!r} is not a size (e.g. 70GiB, 500MB, 1000000)")
        out[k] = int(float(m.group(1))) if m.group(2) is None else val.replace(" ", "")
    return out


def parse_device_map(text: str | None):
    """``auto``/``balanced``/``balanced_low_0``/``sequential``, a device (``cpu``, ``cuda:0``) or a JSON
    object ``{"module.name": device}``."""
    if text is None or not text.strip():
        return None
    text = text.strip()
    if text.startswith("{"):
        import json

        try:
            m = json.loads(text)
        except ValueError as e:
            raise InputError(f"--device-map: invalid JSON ({e})") from None
        if not isinstance(m, dict):
            raise InputError("--device-map: a JSON device map must be an object")
        return m
    if text in ("auto", "balanced", "balanced_low_0", "sequential", "cpu") or re.fullmatch(r"cuda(:\d+)?", text):
        return text
    raise InputError(f"--device-map {text!r}: use auto, balanced, balanced_low_0, sequential, cpu, cuda:N or a "
                     "JSON object")


def placement_from_options(device_map: str | None, max_memory: str | None,
                           offload_dir: str | os.PathLike | None) -> Placement | None:
    """The :class:`Placement` of ``--device-map``, ``--max-memory`` and ``--offload-dir`` (None
    without a device map); the other two need one, and the offload folder must not be a file."""
    dmap, mmem = parse_device_map(device_map), parse_max_memory(max_memory)
    if mmem is not None and dmap is None:
        raise InputError("--max-memory needs --device-map (e.g. --device-map auto)")
    if offload_dir is not None:
        if dmap is None:
            raise InputError("--offload-dir needs --device-map (e.g. --device-map auto)")
        if os.path.exists(offload_dir) and not os.path.isdir(offload_dir):
            raise InputError(f"--offload-dir {offload_dir} is a file, not a folder")
    return Placement(dmap, mmem, str(offload_dir) if offload_dir is not None else None) if dmap is not None else None


def input_device(model) -> "torch.device":
    """Where input ids go: the first parameter that is not offloaded (meta); accelerate's hooks move
    inputs on from there."""
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    import torch

    return torch.device("cpu")
