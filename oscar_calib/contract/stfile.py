"""safetensors files without torch: the header and its layout rules, tensors as numpy arrays, and
the canonical writer.

The layout rules are the safetensors library's own (``Metadata::validate`` and
``SafeTensors::read_metadata`` in ``safetensors/src/tensor.rs``, huggingface/safetensors at
commit 24b0b28): a header of at most 100,000,000 bytes; tensors, in the order of their offsets,
lying back to back from the first data byte, each spanning exactly its shape times its dtype's
width; and the last one ending at the end of the file. A file breaking them is one that every
safetensors reader refuses, so it is refused here with one sentence (a truncated download, a
half-copied checkpoint, two tensors pointing at the same bytes).

Used by ``oscar validate`` and :func:`~oscar_calib.contract.artifact.load_artifact` on artifacts and by
model loading on checkpoint shards (:func:`read_header` reads only the header).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import OscarError

MAX_HEADER_BYTES = 100_000_000
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
# the tags numpy reads (little-endian, as stored); the others (BF16, FP8) are described by name and shape only
_NUMPY_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
                 "U8": "u1", "BOOL": "?", "U16": "<u2", "U32": "<u4", "U64": "<u8"}
_DTYPE_NAMES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
# numpy/torch dtype name -> safetensors tag, for writing
DTYPE_TAGS = {"float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
              "int32": "I32", "uint8": "U8", "int8": "I8"}


@dataclass
class Unread:
    """A tensor numpy cannot hold (bfloat16, FP8): its shape and dtype, for the structure checks."""

    shape: tuple[int, ...]
    dtype: str


def read_header(path: Path) -> tuple[dict, int]:
    """Parse a safetensors file's header, reading only the header, and check the layout rules
    (module docstring) against the file's size. Returns ``(header, data_start)``; raises
    :class:`OscarError` with one clear sentence."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        first = f.read(8)
        n = _header_length(first, size)
        return _parse(f.read(n), n, size), 8 + n


def parse(raw: bytes) -> tuple[dict, int]:
    """:func:`read_header` on a whole file already in memory."""
    n = _header_length(raw[:8], len(raw))
    return _parse(raw[8:8 + n], n, len(raw)), 8 + n


def _header_length(first: bytes, size: int) -> int:
    if len(first) < 8:
        raise OscarError(f"truncated file ({size} bytes): not even a safetensors header length")
    (n,) = struct.unpack("<Q", first)
    if n == 0 or n > size - 8 or n > MAX_HEADER_BYTES:
        raise OscarError(f"truncated or corrupt safetensors file: header claims {n} bytes, file holds {size}")
    return n


def _parse(text: bytes, n: int, size: int) -> dict:
    try:
        header = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        raise OscarError("corrupt safetensors header (not valid JSON)") from None
    if not isinstance(header, dict):
        raise OscarError("corrupt safetensors header (not a JSON object)")
    data_len = size - 8 - n
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            if info is not None and (not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values())):
                raise OscarError("corrupt safetensors header ('__metadata__' is not an object of strings)")
            continue
        try:
            start, stop = (int(x) for x in info["data_offsets"])
            shape = [int(s) for s in info["shape"]]
            width = _DTYPE_BYTES.get(str(info["dtype"]))        # an unknown (newer) dtype: offsets only
        except (KeyError, TypeError, ValueError):
            raise OscarError(f"corrupt safetensors header entry for {name!r}") from None
        if (width is not None and stop - start != math.prod(shape) * width) or start < 0 or stop < start \
                or any(s < 0 for s in shape):
            raise OscarError(f"corrupt safetensors header: {name} has offsets {start}..{stop} for shape {shape}")
        spans.append((start, stop, name))
    end = max((stop for _, stop, _ in spans), default=0)
    if end > data_len:
        raise OscarError(f"truncated file: tensor data needs {end} bytes after the header, the file holds {data_len}")
    at = 0
    for start, stop, name in sorted(spans):
        if start != at:
            what = "overlaps the tensor before it" if start < at else f"leaves bytes {at}..{start} unused"
            raise OscarError(f"corrupt safetensors header: {name} (offsets {start}..{stop}) {what}")
        at = stop
    if end < data_len:
        raise OscarError(f"corrupt safetensors file: {data_len - end} byte(s) after the last tensor's data")
    return header


def tensor_entries(raw: bytes, header: dict, data_start: int) -> list[tuple[str, str, tuple[int, ...], memoryview]]:
    """``(name, dtype tag, shape, bytes)`` of every tensor of a file whose ``header`` :func:`parse`
    checked, in header order; the bytes are views into ``raw``."""
    view = memoryview(raw)
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, stop = (int(x) for x in info["data_offsets"])
        out.append((name, str(info["dtype"]), tuple(int(s) for s in info["shape"]),
                    view[data_start + start:data_start + stop]))
    return out


def read_arrays(raw: bytes, header: dict, data_start: int) -> dict[str, np.ndarray | Unread]:
    """Every tensor of a checked file as a read-only numpy array over ``raw`` (little-endian, as
    stored), or :class:`Unread` for a dtype numpy lacks."""
    out: dict[str, np.ndarray | Unread] = {}
    for name, tag, shape, data in tensor_entries(raw, header, data_start):
        if tag not in _NUMPY_DTYPES:
            out[name] = Unread(shape, _DTYPE_NAMES.get(tag, tag))
            continue
        out[name] = np.frombuffer(data, dtype=_NUMPY_DTYPES[tag], count=math.prod(shape)).reshape(shape)
    return out


def serialize(entries, metadata: dict[str, str]) -> bytes:
    """Canonical safetensors bytes from ``(name, dtype tag, shape, bytes)`` entries: tensors in name
    order, back to back; header JSON with sorted keys and no spaces, padded with spaces to a
    multiple of 8 bytes. The same entries and metadata always give the same bytes, and every
    safetensors reader reads them."""
    header: dict = {"__metadata__": {str(k): str(v) for k, v in sorted(metadata.items())}}
    chunks, offset = [], 0
    for name, tag, shape, data in sorted(entries, key=lambda e: e[0]):
        data = bytes(data)
        header[name] = {"dtype": tag, "shape": [int(s) for s in shape], "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    hjson = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    hjson += b" " * (-len(hjson) % 8)
    return struct.pack("<Q", len(hjson)) + hjson + b"".join(chunks)
