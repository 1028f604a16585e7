"""A seeded set of ~120 mutations of a verified artifact (truncation, bit flips, header edits,
nonsense metadata, NaN/Inf, dtype/shape/offset changes, swapped, dropped and extra tensors, absurd
header lengths): `oscar validate`, load_artifact and export refuse every one with one typed error,
no traceback and a few lines. Edits come both as they land on a file (the stored digest no longer
matches) and as a writer that stamps nonsense with a fresh digest would write them (the metadata
and value checks alone must refuse those)."""

from __future__ import annotations

import json
import random
import struct

import pytest
from factories import make_artifact
from typer.testing import CliRunner

from oscar_calib.cli import app
from oscar_calib.contract import stfile
from oscar_calib.contract.artifact import load_artifact, stamp
from oscar_calib.contract.layout import CARD_NAME, DIGEST_KEY, VERIFY_NAME, WEIGHTS_NAME
from oscar_calib.errors import ArtifactError, OscarError, OscarWarning
from oscar_calib.tools.export.sglang import export_sglang
from oscar_calib.tools.publish import plan_push
from oscar_calib.tools.validate import validate_artifact

runner = CliRunner()
SEED = 20260517
MAX_LINES = 4          # problems per artifact: a root cause and its consequences, never one per tensor


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> bytes:
    """The bytes of a verified artifact (3 layers, 2 KV heads, head_dim 8, shared rotations absent)."""
    art = make_artifact(tmp_path_factory.mktemp("fuzz") / "a", layers=3)
    digest = validate_artifact(art).content_sha256
    (art / VERIFY_NAME).write_text(json.dumps({"passed": True, "content_sha256": digest}))
    assert validate_artifact(art).verification.state == "yes"
    return (art / WEIGHTS_NAME).read_bytes()


# ----------------------------------------------------------------------------- mutations

def _split(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _join(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def _entries(raw: bytes) -> tuple[dict, list]:
    header, start = stfile.parse(raw)
    return dict(header["__metadata__"]), [[n, t, s, bytearray(d)] for n, t, s, d in
                                           stfile.tensor_entries(raw, header, start)]


def _write(md: dict, entries: list, restamp: bool) -> bytes:
    entries = [(n, t, s, bytes(d)) for n, t, s, d in entries]
    return stfile.serialize(entries, stamp(md, entries) if restamp else md)


def truncate(raw, rng, frac):
    return raw[:int(len(raw) * frac)]


def bit_flip(raw, rng, where):
    (n,) = struct.unpack("<Q", raw[:8])
    pos = rng.randrange(8, 8 + n) if where == "header" else rng.randrange(8 + n, len(raw))
    out = bytearray(raw)
    out[pos] ^= 1 << rng.randrange(8)
    return bytes(out)


def set_metadata(raw, rng, key, value, restamp):
    md, entries = _entries(raw)
    if value is None:
        md.pop(key, None)
    else:
        md[key] = value
    if not restamp:
        header, data = _split(raw)
        header["__metadata__"] = md
        return _join(header, data)
    return _write(md, entries, True)


def set_value(raw, rng, name, index, value, restamp):
    md, entries = _entries(raw)
    for e in entries:
        if e[0] == name:
            e[3][4 * index:4 * index + 4] = struct.pack("<f", value)
    return _write(md, entries, restamp)


def header_entry(raw, rng, name, field, value):
    header, data = _split(raw)
    if callable(value):
        value = value(header)
    header[name][field] = value
    return _join(header, data)


def swap_data(raw, rng, a, b, restamp):
    md, entries = _entries(raw)
    ea, eb = (next(e for e in entries if e[0] == n) for n in (a, b))
    ea[3], eb[3] = eb[3], ea[3]
    return _write(md, entries, restamp)


def swap_names(raw, rng, a, b):
    header, data = _split(raw)
    header[a], header[b] = header[b], header[a]
    return _join(header, data)


def drop(raw, rng, name, restamp):
    md, entries = _entries(raw)
    return _write(md, [e for e in entries if e[0] != name], restamp)


def extra(raw, rng, name, restamp):
    md, entries = _entries(raw)
    src = next(e for e in entries if e[0] == "layers.0.k_rotation")
    return _write(md, entries + [[name, src[1], src[2], bytearray(src[3])]], restamp)


def header_length(raw, rng, value):
    n = value(struct.unpack("<Q", raw[:8])[0], len(raw))
    return struct.pack("<Q", n) + raw[8:]


NONSENSE = [
    ("model_type", "-1"), ("model_type", "2147483648"), ("model_type", ""), ("model_type", "llama; rm -rf /"),
    ("recent_tokens", "1000000000000"), ("recent_tokens", "-5"), ("recent_tokens", "1e3"), ("recent_tokens", "２５６"),
    ("recent_tokens", "9" * 30), ("sink_tokens", "16777217"), ("head_dim", "3"), ("head_dim", "0"),
    ("head_dim", "16"), ("num_layers", "4"), ("num_layers", "0"), ("num_layers", "1000000000000"),
    ("num_kv_heads", "1"), ("num_attention_heads", "5"), ("num_attention_heads", "4096"), ("group_size", "3"),
    ("group_size", "2"), ("group_size", "16"), ("bits", "4"), ("format_version", "2"), ("format", "pt"),
    ("granularity", "token"), ("calibration", "[]"), ("model_fingerprint", "z" * 64), ("fork_k_clip", "1.5"),
    ("layer_group_sizes", "8,8"), ("v_folded", "yes"), ("model_id", None), ("composition", "magic"),
]


def cases() -> list[tuple[str, object, tuple]]:
    rng = random.Random(SEED)
    out = [(f"truncate-{f:.3f}", truncate, (f,)) for f in sorted(rng.random() for _ in range(12))]
    out += [(f"truncate-{f}", truncate, (f,)) for f in (0.0, 0.001, 0.999)]
    out += [(f"flip-header-{i}", bit_flip, ("header",)) for i in range(15)]
    out += [(f"flip-data-{i}", bit_flip, ("data",)) for i in range(15)]
    for key, value in NONSENSE:
        for restamp in (False, True):
            out.append((f"metadata-{key}={value}{'-restamped' if restamp else ''}", set_metadata,
                        (key, value, restamp)))
    out.append(("metadata-digest-zeros", set_metadata, (DIGEST_KEY, "0" * 64, False)))
    out.append(("metadata-digest-short", set_metadata, (DIGEST_KEY, "abc", False)))
    out.append(("metadata-extra-key", set_metadata, ("note", "hello", False)))
    for name, index in (("layers.0.k_rotation", 5), ("layers.2.v_eigenvalues", 0), ("layers.1.k_clip", 1)):
        for value in (float("nan"), float("inf"), float("-inf")):
            out.append((f"value-{name}[{index}]={value}", set_value, (name, index, value, True)))
    out.append(("value-clip-above-1", set_value, ("layers.1.v_clip", 0, 1.5, True)))
    out.append(("value-clip-zero-unstamped", set_value, ("layers.1.v_clip", 0, 0.0, False)))
    out.append(("value-eigen-ascending", set_value, ("layers.0.k_eigenvalues", 7, 99.0, True)))
    out.append(("value-rotation-scaled", set_value, ("layers.2.v_rotation", 0, 2.0, True)))
    out += [
        ("dtype-F16", header_entry, ("layers.0.k_clip", "dtype", "F16")),
        ("dtype-I32", header_entry, ("layers.0.k_rotation", "dtype", "I32")),
        ("dtype-BF16", header_entry, ("layers.1.v_clip", "dtype", "BF16")),
        ("dtype-unknown", header_entry, ("layers.1.v_clip", "dtype", "Q2")),
        ("shape-flat", header_entry, ("layers.0.k_rotation", "shape", [2, 64])),
        ("shape-transposed", header_entry, ("layers.0.k_eigenvalues", "shape", [8, 2])),
        ("shape-negative", header_entry, ("layers.0.k_clip", "shape", [-2])),
        ("shape-huge", header_entry, ("layers.0.k_clip", "shape", [2 ** 40])),
        ("offsets-aliased", header_entry, ("layers.0.k_rotation", "data_offsets",
                                           lambda h: list(h["layers.1.k_rotation"]["data_offsets"]))),
        ("offsets-shifted", header_entry, ("layers.0.k_rotation", "data_offsets",
                                           lambda h: [x + 4 for x in h["layers.0.k_rotation"]["data_offsets"]])),
        ("offsets-reversed", header_entry, ("layers.0.k_clip", "data_offsets",
                                            lambda h: h["layers.0.k_clip"]["data_offsets"][::-1])),
        ("offsets-strings", header_entry, ("layers.0.k_clip", "data_offsets", ["a", "b"])),
    ]
    out += [        # swapped data restamped would be a sound artifact of other rotations: only as found on a file
        ("swap-layers", swap_data, ("layers.0.k_rotation", "layers.2.k_rotation", False)),
        ("swap-k-v", swap_data, ("layers.1.k_rotation", "layers.1.v_rotation", False)),
        ("swap-clips", swap_data, ("layers.0.k_clip", "layers.0.v_clip", False)),
    ]
    for restamp in (False, True):
        tag = "-restamped" if restamp else ""
        out += [
            (f"drop-rotation{tag}", drop, ("layers.1.v_rotation", restamp)),
            (f"drop-last-layer-clip{tag}", drop, ("layers.2.k_clip", restamp)),
            (f"extra-layer{tag}", extra, ("layers.3.k_rotation", restamp)),
            (f"extra-junk{tag}", extra, ("junk", restamp)),
        ]
    out += [("swap-names", swap_names, ("layers.0.v_rotation", "layers.2.v_rotation"))]
    out += [
        ("hlen-zero", header_length, (lambda n, size: 0,)),
        ("hlen-minus-one", header_length, (lambda n, size: n - 1,)),
        ("hlen-plus-one", header_length, (lambda n, size: n + 1,)),
        ("hlen-file", header_length, (lambda n, size: size,)),
        ("hlen-2^63", header_length, (lambda n, size: 2 ** 63,)),
        ("hlen-2^64-1", header_length, (lambda n, size: 2 ** 64 - 1,)),
        ("hlen-100M+1", header_length, (lambda n, size: 100_000_001,)),
    ]
    return out


CASES = cases()


def test_the_mutation_set_is_large_and_seeded():
    assert len(CASES) >= 120 and len({name for name, _, _ in CASES}) == len(CASES)
    assert [name for name, _, _ in cases()] == [name for name, _, _ in CASES]


@pytest.mark.parametrize("name, mutate, args", CASES, ids=[c[0] for c in CASES])
def test_every_mutation_is_refused_with_one_typed_error(original, tmp_path, name, mutate, args):
    rng = random.Random(f"{SEED}-{name}")
    art = tmp_path / "a"
    art.mkdir()
    raw = mutate(original, rng, *args)
    assert raw != original, "a mutation must change the file"
    (art / WEIGHTS_NAME).write_bytes(raw)
    (art / CARD_NAME).write_text("# card\n")
    report = validate_artifact(art)
    if report.ok:
        # only when the mutation took the digest key itself away (a flip in its name): the file then reads
        # as one written before digests, with a warning, and is never published
        assert DIGEST_KEY not in report.metadata and DIGEST_KEY.encode() not in raw, name
        assert any("no content digest" in w for w in report.warnings)
        with pytest.warns(OscarWarning, match="no content digest"):
            load_artifact(art)
        with pytest.raises(ArtifactError, match="carries no content digest"):
            plan_push(art, "hf:org/name", force=True)
        return
    assert 1 <= len(report.problems) <= MAX_LINES, report.problems
    with pytest.raises(ArtifactError) as exc:
        load_artifact(art)
    assert "\n" not in str(exc.value)
    with pytest.raises(OscarError):
        export_sglang(art, tmp_path / "serve", clip=(0.9, 0.9))
    assert not (tmp_path / "serve").exists()
    result = runner.invoke(app, ["validate", str(art)])
    assert result.exit_code == 1 and (result.exception is None or isinstance(result.exception, SystemExit))
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith(f"{art}: ") and ": warning:" not in ln]
    assert len(lines) == len(report.problems) and "Traceback" not in result.output


def test_named_nonsense_gets_its_own_line(original, tmp_path):
    """The issue's cases, as a writer stamping them with a fresh digest would write them."""
    expected = {
        ("model_type", "-1"): "metadata 'model_type' is '-1', not a transformers model type",
        ("model_type", "2147483648"): "metadata 'model_type' is '2147483648', not a transformers model type",
        ("recent_tokens", "1000000000000"): "metadata 'recent_tokens' is 1000000000000, beyond any model",
        ("head_dim", "3"): "metadata head_dim=3 but every rotation is 8x8 (6 of them)",
        ("num_layers", "4"): "metadata num_layers=4 but the file holds rotations for 3 layers (0-2)",
        ("sink_tokens", "16777217"): "BF16 windows of 16777217 sink + 256 recent tokens exceed the limit",
    }
    for (key, value), line in expected.items():
        art = tmp_path / f"{key}-{value}"
        art.mkdir()
        (art / WEIGHTS_NAME).write_bytes(set_metadata(original, None, key, value, True))
        report = validate_artifact(art)
        assert report.problems[0].startswith(line), report.problems
        assert report.checks.get("digest") is True                     # the digest vouches; the bounds refuse
        with pytest.raises(ArtifactError) as exc:
            load_artifact(art)
        assert str(exc.value).startswith(f"{art}: {line}")
