"""A safetensors file read without its tensor data: the header, and the check that the file holds
every byte the header promises (what a truncated download or a half-copied checkpoint fails).
Used by ``oscar validate`` on artifacts and by model loading on checkpoint shards."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from ..errors import OscarError

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def read_header(path: Path) -> tuple[dict, int]:
    """Parse a safetensors header and check that every tensor's bytes lie inside the file (and, for
    the dtypes listed above, that its byte range fits its shape). Returns ``(header, data_start)``;
    raises :class:`OscarError` with one clear sentence."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise OscarError(f"truncated file ({size} bytes): not even a safetensors header length")
        (n,) = struct.unpack("<Q", raw)
        if n == 0 or n > size - 8 or n > 100_000_000:
            raise OscarError(f"truncated or corrupt safetensors file: header claims {n} bytes, file holds {size}")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise OscarError("corrupt safetensors header (not valid JSON)") from None
    if not isinstance(header, dict):
        raise OscarError("corrupt safetensors header (not a JSON object)")
    data_len = size - 8 - n
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            if info is not None and not isinstance(info, dict):
                raise OscarError("corrupt safetensors header ('__metadata__' is not an object)")
            continue
        try:
            start, stop = (int(x) for x in info["data_offsets"])
            shape = [int(s) for s in info["shape"]]
            width = _DTYPE_BYTES.get(str(info["dtype"]))        # an unknown (newer) dtype: offsets only
        except (KeyError, TypeError, ValueError):
            raise OscarError(f"corrupt safetensors header entry for {name!r}") from None
        if (width is not None and stop - start != math.prod(shape) * width) or start < 0 or stop < start:
            raise OscarError(f"corrupt safetensors header: {name} has offsets {start}..{stop} for shape {shape}")
        end = max(end, stop)
    if end > data_len:
        raise OscarError(f"truncated file: tensor data needs {end} bytes after the header, the file holds {data_len}")
    return header, 8 + n
