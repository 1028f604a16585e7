"""The content digest (contract.digest): defined by its documented encoding, computed alike from the file's
bytes and from tensors in memory, blind to header layout, sensitive to every name, dtype, shape, byte
and metadata value; the safetensors layout rules of contract.stfile; the contract modules import no circle."""

from __future__ import annotations

import ast
import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch
from factories import make_artifact

from oscar_calib.contract import stfile
from oscar_calib.contract.artifact import (
    load_artifact,
    read_metadata,
    serialize_artifact,
)
from oscar_calib.contract.checks import inspect_bytes
from oscar_calib.contract.digest import content_digest
from oscar_calib.contract.layout import DIGEST_KEY, WEIGHTS_NAME
from oscar_calib.errors import OscarError

CONTRACT = Path(__file__).resolve().parents[2] / "oscar_calib" / "contract"


def documented_digest(metadata: dict, tensors: dict) -> str:
    """The encoding exactly as contract/digest.py's docstring states it, written out again here."""
    def u64(n):
        return struct.pack("<Q", n)

    def text(s):
        return u64(len(s.encode())) + s.encode()

    out = b"oscar-content-sha256-v1\n"
    items = sorted((k, v) for k, v in metadata.items() if k != "content_sha256")
    out += u64(len(items)) + b"".join(text(k) + text(v) for k, v in items)
    out += u64(len(tensors))
    for name in sorted(tensors):
        tag, shape, data = tensors[name]
        out += text(name) + text(tag) + u64(len(shape)) + b"".join(u64(s) for s in shape) + u64(len(data)) + data
    return hashlib.sha256(out).hexdigest()


def file_parts(path: Path) -> tuple[dict, dict]:
    raw = path.read_bytes()
    header, start = stfile.parse(raw)
    tensors = {n: (t, s, bytes(d)) for n, t, s, d in stfile.tensor_entries(raw, header, start)}
    return dict(header["__metadata__"]), tensors


def test_written_digest_is_the_documented_one(tmp_path):
    art = make_artifact(tmp_path / "a")
    md, tensors = file_parts(art / WEIGHTS_NAME)
    assert md[DIGEST_KEY] == documented_digest(md, tensors)
    report, _ = inspect_bytes((art / WEIGHTS_NAME).read_bytes(), art)
    assert report.ok and report.content_sha256 == md[DIGEST_KEY] and report.warnings == []
    loaded = load_artifact(art)
    assert loaded.content_sha256 == loaded.metadata[DIGEST_KEY] == md[DIGEST_KEY]


def test_digest_ignores_header_layout_and_itself(tmp_path):
    """The stock safetensors writer (another key order, other padding) gives the same digest; so
    does any value of the digest key itself."""
    from safetensors.torch import save_file

    art = make_artifact(tmp_path / "a")
    md, tensors = file_parts(art / WEIGHTS_NAME)
    loaded = load_artifact(art)
    other = tmp_path / "stock.safetensors"
    save_file(loaded.tensors(), str(other), metadata={k: v for k, v in md.items() if k != DIGEST_KEY})
    assert other.read_bytes() != (art / WEIGHTS_NAME).read_bytes()
    md2, tensors2 = file_parts(other)
    assert content_digest(md2, [(n, *v) for n, v in tensors2.items()]) == md[DIGEST_KEY]
    assert content_digest(md | {DIGEST_KEY: "x"}, [(n, *v) for n, v in tensors.items()]) == md[DIGEST_KEY]


def _changed(md, tensors, what):
    md, tensors = dict(md), dict(tensors)
    names = sorted(tensors)
    if what == "metadata value":
        md["recent_tokens"] = "255"
    elif what == "metadata key":
        md["recent_tokens "] = md.pop("recent_tokens")
    elif what == "extra metadata":
        md["note"] = ""
    elif what == "one byte":
        tag, shape, data = tensors[names[3]]
        tensors[names[3]] = (tag, shape, data[:5] + bytes([data[5] ^ 1]) + data[6:])
    elif what == "dtype":
        tag, shape, data = tensors[names[0]]
        tensors[names[0]] = ("I32", shape, data)            # same bytes, read as integers
    elif what == "shape":
        tag, shape, data = tensors["layers.0.k_eigenvalues"]
        tensors["layers.0.k_eigenvalues"] = (tag, shape[::-1], data)
    elif what == "swapped names":
        a, b = "layers.0.k_rotation", "layers.1.k_rotation"
        tensors[a], tensors[b] = tensors[b], tensors[a]
    elif what == "bytes moved across a boundary":
        a, b = names[0], names[1]
        (ta, sa, da), (tb, sb, db) = tensors[a], tensors[b]
        tensors[a], tensors[b] = (ta, sa, da + db[:4]), (tb, sb, db[4:])
    elif what == "dropped tensor":
        del tensors[names[-1]]
    return md, tensors


@pytest.mark.parametrize("what", ["metadata value", "metadata key", "extra metadata", "one byte", "dtype", "shape",
                                  "swapped names", "bytes moved across a boundary", "dropped tensor"])
def test_every_change_changes_the_digest(tmp_path, what):
    md, tensors = file_parts(make_artifact(tmp_path / "a") / WEIGHTS_NAME)
    md2, tensors2 = _changed(md, tensors, what)
    assert content_digest(md2, [(n, *v) for n, v in tensors2.items()]) != md[DIGEST_KEY]
    assert documented_digest(md2, tensors2) != md[DIGEST_KEY]


def test_memory_and_file_agree_and_writes_are_deterministic(tmp_path):
    art = load_artifact(make_artifact(tmp_path / "a"))
    data = serialize_artifact(art.tensors(), art.metadata)
    assert data == (tmp_path / "a" / WEIGHTS_NAME).read_bytes()
    stale = dict(art.metadata, **{DIGEST_KEY: "0" * 64})               # a digest given is replaced
    assert serialize_artifact(art.tensors(), stale) == data
    assert read_metadata(tmp_path / "a")[DIGEST_KEY] == art.content_sha256


# ----------------------------------------------------------------------------- safetensors layout rules

def _rewrite_header(path: Path, edit) -> bytes:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + raw[8 + n:]


def _alias(h):          # layer 0's K rotation read from layer 1's bytes
    h["layers.0.k_rotation"]["data_offsets"] = list(h["layers.1.k_rotation"]["data_offsets"])


def _number_metadata(h):
    h["__metadata__"]["num_layers"] = 2


@pytest.mark.parametrize("edit, message", [
    (_alias, "overlaps the tensor before it|unused"),      # two tensors on the same bytes: a gap and an overlap
    (_number_metadata, "'__metadata__' is not an object of strings"),
])
def test_layout_rules(tmp_path, edit, message):
    art = make_artifact(tmp_path / "a")
    with pytest.raises(OscarError, match=message):
        stfile.parse(_rewrite_header(art / WEIGHTS_NAME, edit))


def test_trailing_bytes_and_gaps_are_refused(tmp_path):
    raw = (make_artifact(tmp_path / "a") / WEIGHTS_NAME).read_bytes()
    with pytest.raises(OscarError, match=r"4 byte\(s\) after the last tensor"):
        stfile.parse(raw + b"\0" * 4)

    def drop_first(h):
        first = min((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
        del h[first]
    with pytest.raises(OscarError, match=r"leaves bytes 0\.\.8 unused"):          # layers.0.k_clip: 2 float32
        stfile.parse(_rewrite_header(tmp_path / "a" / WEIGHTS_NAME, drop_first))


def test_safetensors_reads_what_stfile_writes(tmp_path):
    """The canonical writer's files load in the safetensors library itself, tensor for tensor."""
    from safetensors.torch import load_file

    art = make_artifact(tmp_path / "a")
    loaded = load_file(str(art / WEIGHTS_NAME))
    ours = load_artifact(art).tensors()
    assert loaded.keys() == ours.keys() and all(torch.equal(loaded[k], ours[k]) for k in ours)


# ----------------------------------------------------------------------------- one way imports

def test_contract_modules_import_no_circle():
    """The contract's modules form a DAG (artifact <-> values was a circle): every import between
    them, at module level or inside a function, points one way."""
    graph = {}
    for path in CONTRACT.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:
                    deps.update(a.name for a in node.names)
        graph[path.stem] = deps & {p.stem for p in CONTRACT.glob("*.py")}
    assert "artifact" not in graph["values"] and "artifact" not in graph["checks"]
    done, visiting = set(), []

    def visit(m):
        assert m not in visiting, f"import circle: {' -> '.join(visiting + [m])}"
        if m in done:
            return
        visiting.append(m)
        for d in graph[m]:
            visit(d)
        visiting.pop()
        done.add(m)
    for m in graph:
        visit(m)
