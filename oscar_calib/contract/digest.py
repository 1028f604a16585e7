"""The content digest of an artifact: what its metadata key ``content_sha256`` holds.

sha256 over a canonical encoding of what the file says, so that the same content gives the same
digest however its header happens to be laid out, and any change to a tensor's bytes, name,
dtype or shape, or to a metadata value, gives another. Every integer below is an unsigned
64-bit little-endian number; every string is UTF-8, preceded by its length in bytes::

    b"oscar-content-sha256-v1\\n"
    number of metadata items, then for each item sorted by key: key, value
        (every metadata item except content_sha256 itself)
    number of tensors, then for each tensor sorted by name:
        name, dtype (the safetensors tag: "F32"), number of dimensions, each dimension,
        length of the data in bytes, the data (little-endian, exactly as stored)

The digest is 64 lowercase hex digits. It is computed from the file's bytes alone (numpy, no
torch: ``oscar validate`` uses it) and from tensors in memory before they are written
(:func:`~oscar_calib.contract.artifact.serialize_artifact`), by the one function :func:`content_digest`.
Leaving the key out of its own digest means adding a digest to an older file changes nothing the
digest covers: a ``verify.json`` written before still matches.

Not covered, because no reader sees them: the order of keys in the header, its padding.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Iterable, Mapping, Sequence

from .layout import DIGEST_KEY

DOMAIN = b"oscar-content-sha256-v1\n"
HEX_DIGEST = re.compile(r"[0-9a-f]{64}")


def _u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def _text(s: str) -> bytes:
    b = str(s).encode("utf-8", "surrogatepass")
    return _u64(len(b)) + b


def content_digest(metadata: Mapping[str, str],
                   entries: Iterable[tuple[str, str, Sequence[int], bytes | memoryview]]) -> str:
    """The digest of ``metadata`` (its ``content_sha256`` left out) and the tensors ``entries``:
    ``(name, safetensors dtype tag, shape, raw bytes)`` in any order."""
    h = hashlib.sha256(DOMAIN)
    items = sorted((str(k), str(v)) for k, v in metadata.items() if k != DIGEST_KEY)
    h.update(_u64(len(items)))
    for k, v in items:
        h.update(_text(k) + _text(v))
    rows = sorted(entries, key=lambda e: str(e[0]).encode("utf-8", "surrogatepass"))
    h.update(_u64(len(rows)))
    for name, tag, shape, data in rows:
        h.update(_text(name) + _text(tag) + _u64(len(shape)) + b"".join(_u64(int(s)) for s in shape))
        h.update(_u64(len(data)))
        h.update(data)
    return h.hexdigest()


def digest_problem(stored: str | None, computed: str) -> str | None:
    """Why a stored digest does not vouch for content that hashes to ``computed`` (None when it
    does, or when there is none: see :func:`missing_digest_warning`)."""
    if stored is None or stored == computed:
        return None
    if not HEX_DIGEST.fullmatch(stored):
        return f"metadata {DIGEST_KEY!r} is not a sha256 hex digest: {stored[:20]!r}"
    return (f"content changed after it was written: metadata {DIGEST_KEY} is {stored[:16]}…, the tensors and "
            f"metadata now hash to {computed[:16]}… (edited or corrupted; restore the file or calibrate again)")


def missing_digest_warning(where) -> str:
    return (f"no content digest ({DIGEST_KEY}; written before oscar stored one): a later change to it cannot be "
            f"detected; `oscar validate --fix-digest {where}` adds it")
