"""The verify gate bound to the bytes: verify.json records the content it verified; every reader
refuses content changed after it was written (swapped layers, a bit flip that keeps a rotation
orthogonal); push refuses an artifact replaced after verify unless --force; --fix-digest, pull and
the zoo rules."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from factories import FAST, loaded_tiny, make_artifact
from typer.testing import CliRunner

import oscar_calib.tools.publish as publish
from oscar_calib import __version__
from oscar_calib.cli import app
from oscar_calib.contract import stfile
from oscar_calib.contract.artifact import (
    load_artifact,
    read_metadata,
    write_artifact_files,
)
from oscar_calib.contract.layout import (
    CARD_NAME,
    DIGEST_KEY,
    REPORT_NAME,
    VERIFY_NAME,
    WEIGHTS_NAME,
)
from oscar_calib.contract.values import check_values
from oscar_calib.errors import ArtifactError, InputError, OscarWarning
from oscar_calib.tools.validate import fix_digest, validate_artifact

runner = CliRunner()
QUICK = dict(depths=(400, 700), sequences=1, positions=2)
CHANGED = "content changed after it was written"


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    """A tiny Llama's calibrated artifact and ``oscar verify``'s verify.json for it (read-only)."""
    from oscar_calib.calibration.pipeline import calibrate
    from oscar_calib.contract.config import CalibrationConfig
    from oscar_calib.eval.verify import verify_artifact

    lm = loaded_tiny("llama")
    out = tmp_path_factory.mktemp("gate") / "a"
    calibrate(CalibrationConfig(**{**FAST, "tokens": 256, "seq_len": 64, "heldout_tokens": 32}), out, loaded=lm)
    result = verify_artifact(out, loaded=lm, backend="torch", plot=False, **QUICK)
    assert result.passed, result.reasons
    return out, lm


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_data(path: Path, change) -> None:
    """Apply ``change(raw_data_by_name)`` to the tensors' bytes in place, header untouched."""
    raw = bytearray(path.read_bytes())
    header, start = stfile.parse(bytes(raw))
    spans = {n: (start + h["data_offsets"][0], start + h["data_offsets"][1]) for n, h in header.items()
             if n != "__metadata__"}
    data = {n: bytearray(raw[a:b]) for n, (a, b) in spans.items()}
    change(data)
    for n, (a, b) in spans.items():
        assert len(data[n]) == b - a
        raw[a:b] = data[n]
    path.write_bytes(bytes(raw))


def swap_layers(data):
    """Layer 0 quantised with layer 1's key basis: both still orthogonal, same shapes."""
    data["layers.0.k_rotation"], data["layers.1.k_rotation"] = data["layers.1.k_rotation"], data["layers.0.k_rotation"]


def flip_low_bit(data):
    """The lowest mantissa bit of one float32 of a value rotation: ‖RRᵀ − I‖ moves by ~1e-7."""
    data["layers.1.v_rotation"][4 * 5] ^= 1


def test_verify_json_records_what_it_verified(verified):
    art, lm = verified
    doc = json.loads((art / VERIFY_NAME).read_text())
    assert doc["content_sha256"] == read_metadata(art)[DIGEST_KEY] == load_artifact(art).content_sha256
    assert doc["model_fingerprint"] == lm.fingerprint and doc["toolkit_version"] == __version__
    report = json.loads((art / REPORT_NAME).read_text())
    assert report[DIGEST_KEY] == doc["content_sha256"]                        # calibration.json and the card
    assert f"| content digest | `{doc['content_sha256']}`" in (art / CARD_NAME).read_text()
    assert validate_artifact(art).verification.state == "yes"
    result = runner.invoke(app, ["push", str(art), "--to", "hf:org/name", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "verified: yes" in result.stdout and f"digest:   {doc['content_sha256']}" in result.stdout


@pytest.mark.parametrize("change", [swap_layers, flip_low_bit], ids=["swapped layers", "orthogonal bit flip"])
def test_changed_content_is_refused_by_every_reader(verified, tmp_path, change):
    from oscar_calib.eval import EvalOptions, run_eval
    from oscar_calib.eval.verify import verify_artifact
    from oscar_calib.runtime import OscarCache, SimulatedCache
    from oscar_calib.runtime.scheme import KVScheme
    from oscar_calib.tools.export.sglang import export_sglang
    from oscar_calib.tools.fold import fold_checkpoint
    from oscar_calib.tools.zoo import describe

    art, lm = verified
    bad = copy(art, tmp_path / "bad")
    rewrite_data(bad / WEIGHTS_NAME, change)
    raw = (bad / WEIGHTS_NAME).read_bytes()
    header, start = stfile.parse(raw)
    arrays = stfile.read_arrays(raw, header, start)
    md = {k: v for k, v in header["__metadata__"].items() if k != DIGEST_KEY}
    assert not any(check_values(arrays, md).values())          # without the digest nothing would notice
    report = validate_artifact(bad)
    assert [check for check, _ in report.findings] == ["digest"] and CHANGED in report.problems[0]
    nowhere = "no-such-org/no-such-model"
    readers = {
        "load_artifact": lambda: load_artifact(bad),
        "verify": lambda: verify_artifact(bad, loaded=lm, backend="torch", **QUICK),
        "eval": lambda: run_eval(nowhere, bad, EvalOptions(methods="bf16,oscar")),
        "fold-weights": lambda: fold_checkpoint(nowhere, bad, tmp_path / "folded"),
        "export": lambda: export_sglang(bad, tmp_path / "exported", clip=(0.9, 0.9)),
        "OscarCache": lambda: OscarCache.from_artifact(bad, lm.model),
        "SimulatedCache": lambda: SimulatedCache.from_artifact(bad, lm.model),
        "KVScheme": lambda: KVScheme.from_artifact(bad),
        "KVScheme.shared": lambda: KVScheme.shared_from_artifact(bad, clips=(0.9, 0.9)),
        "push": lambda: publish.plan_push(bad, "hf:org/name", force=True),
    }
    for name, read in readers.items():
        with pytest.raises(ArtifactError, match=CHANGED):
            read()
    assert describe(bad, name="bad", source="local").error.startswith(CHANGED)
    for args in (["validate", str(bad)], ["push", str(bad), "--to", "hf:org/name", "--dry-run", "--force"],
                 ["validate", str(bad), "--fix-digest"]):
        result = runner.invoke(app, args)
        assert result.exit_code != 0, args
        assert CHANGED in result.output + str(result.exception), args
    assert (bad / WEIGHTS_NAME).read_bytes() == raw                         # --fix-digest left it as it was
    assert json.loads((bad / VERIFY_NAME).read_text()) == json.loads((art / VERIFY_NAME).read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]             # nothing written


def test_an_artifact_replaced_after_verify_is_stale(verified, tmp_path):
    """A valid artifact (written the toolkit's way, with its own digest) beside an older verify.json:
    every reader takes it, but it is not verified: validate says stale, push refuses without
    --force, and with --force says what it skips."""
    art, _ = verified
    moved = copy(art, tmp_path / "moved")
    a = load_artifact(moved)
    a.metadata["recent_tokens"] = "128"                   # re-calibrated, edited: other content
    write_artifact_files(moved, a, (moved / CARD_NAME).read_text(), a.report)
    assert load_artifact(moved).content_sha256 != load_artifact(art).content_sha256
    report = validate_artifact(moved)
    assert report.ok and report.verification.state == "stale" and "changed after it was verified" in \
        report.verification.why
    result = runner.invoke(app, ["validate", str(moved)])
    assert result.exit_code == 0 and "stale" in result.stdout
    assert f"{moved}: verified: stale: verify.json passed on content" in result.stderr
    with pytest.raises(ArtifactError, match="is stale: verify.json passed on content .* run `oscar verify"):
        publish.plan_push(moved, "hf:org/name")
    result = runner.invoke(app, ["push", str(moved), "--to", "hf:org/name", "--dry-run"])
    assert result.exit_code != 0 and "pass --force to push it unverified" in str(result.exception)
    result = runner.invoke(app, ["push", str(moved), "--to", "hf:org/name", "--dry-run", "--force", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["verified"] is False and doc["verification"] == "stale"
    assert "warning: --force skips the verification gate: verify.json passed on content" in result.stderr
    # a verify.json that does not say which content it verified (an older toolkit's) is stale too
    old = json.loads((art / VERIFY_NAME).read_text())
    del old["content_sha256"]
    (moved / VERIFY_NAME).write_text(json.dumps(old))
    assert "does not record which content" in validate_artifact(moved).verification.why


def _strip_digest(path: Path) -> None:
    """What an artifact written before the digest existed looks like: the same content, no key."""
    raw = path.read_bytes()
    header, start = stfile.parse(raw)
    md = {k: v for k, v in header["__metadata__"].items() if k != DIGEST_KEY}
    path.write_bytes(stfile.serialize(stfile.tensor_entries(raw, header, start), md))


def test_fix_digest_adds_a_missing_digest_and_nothing_else(verified, tmp_path):
    art, _ = verified
    old = copy(art, tmp_path / "old")
    report = json.loads((old / REPORT_NAME).read_text())
    del report[DIGEST_KEY]
    (old / REPORT_NAME).write_text(json.dumps(report))
    from oscar_calib.contract.card import model_card

    (old / CARD_NAME).write_text(model_card(report))                    # the card an older toolkit generated
    _strip_digest(old / WEIGHTS_NAME)
    before = old / WEIGHTS_NAME
    raw_before = before.read_bytes()
    r = validate_artifact(old)
    assert r.ok and not r.has_digest and "no content digest" in r.warnings[0]
    assert r.verification.state == "yes"                # the digest leaves itself out: verify.json still matches
    with pytest.warns(OscarWarning, match="no content digest"):
        load_artifact(old)
    with pytest.raises(ArtifactError, match="carries no content digest.*--fix-digest"):
        publish.plan_push(old, "hf:org/name", force=True)

    result = runner.invoke(app, ["validate", str(old), "--fix-digest"])
    assert result.exit_code == 0, result.output
    assert "stored content digest" in result.stderr and "recorded in calibration.json and README.md" in result.stderr
    md = read_metadata(old)
    assert md[DIGEST_KEY] == r.content_sha256
    a, b = stfile.parse(raw_before), stfile.parse(before.read_bytes())
    assert [(n, t, s, bytes(d)) for n, t, s, d in stfile.tensor_entries(raw_before, *a)] == \
        [(n, t, s, bytes(d)) for n, t, s, d in stfile.tensor_entries(before.read_bytes(), *b)]
    assert json.loads((old / REPORT_NAME).read_text())[DIGEST_KEY] == md[DIGEST_KEY]
    assert md[DIGEST_KEY] in (old / CARD_NAME).read_text()
    assert validate_artifact(old).verification.state == "yes" and not validate_artifact(old).warnings
    assert publish.plan_push(old, "hf:org/name").verified
    assert fix_digest(old).endswith("content digest already stored (" + md[DIGEST_KEY][:16] + "…)")
    assert not list(old.glob(".*.tmp"))


def test_fix_digest_keeps_hand_written_cards_and_refuses_invalid_artifacts(tmp_path):
    art = make_artifact(tmp_path / "a")
    _strip_digest(art / WEIGHTS_NAME)
    card = (art / CARD_NAME).read_text()
    line = fix_digest(art)
    assert line.endswith("recorded in calibration.json") and (art / CARD_NAME).read_text() == card
    bad = make_artifact(tmp_path / "nan")

    def nan(data):
        data["layers.0.k_clip"][:4] = struct.pack("<f", float("nan"))
    _strip_digest(bad / WEIGHTS_NAME)
    rewrite_data(bad / WEIGHTS_NAME, nan)
    raw = (bad / WEIGHTS_NAME).read_bytes()
    with pytest.raises(ArtifactError, match="non-finite"):
        fix_digest(bad)
    assert (bad / WEIGHTS_NAME).read_bytes() == raw
    with pytest.raises(InputError, match="takes no hub repositories"):
        runner.invoke(app, ["validate", "hf:org/name", "--fix-digest"], catch_exceptions=False)


def test_pull_stores_the_digest_of_an_older_artifact(tmp_path, monkeypatch):
    src = make_artifact(tmp_path / "remote")
    _strip_digest(src / WEIGHTS_NAME)
    monkeypatch.setenv("OSCAR_CACHE", str(tmp_path / "cache"))

    def download(**kwargs):
        for f in src.iterdir():
            shutil.copy(f, Path(kwargs["local_dir"]) / f.name)
    monkeypatch.setattr(publish, "hf_snapshot_download", download)
    result = publish.pull("hf:org/older", out=tmp_path / "pulled")
    assert result.report.ok and result.report.has_digest and not result.report.warnings
    assert read_metadata(tmp_path / "pulled")[DIGEST_KEY] == validate_artifact(src).content_sha256
    assert (tmp_path / "pulled" / CARD_NAME).read_text() == (src / CARD_NAME).read_text()     # only the weights


def test_zoo_artifacts_need_a_digest_and_a_fresh_verification(tmp_path):
    from oscar_calib.tools.validate_ci import check_index, github_lines
    from oscar_calib.tools.zoo import write_index

    zoo = tmp_path / "zoo"
    a, b = make_artifact(zoo / "a"), make_artifact(zoo / "b", seed=1)
    (b / VERIFY_NAME).write_text(json.dumps({"passed": True, "content_sha256": "0" * 64}))
    _strip_digest(a / WEIGHTS_NAME)
    write_index(zoo)
    report = check_index(zoo / "index.json")
    assert report.checks == {"index": True, "zoo": False}
    assert report.problems == [f"a: carries no content digest; run `oscar validate --fix-digest {a}`",
                               f"b: its verify.json verified other content; run `oscar verify {b}` again"]
    lines = github_lines([validate_artifact(a), validate_artifact(b)])
    assert lines[0].startswith("::warning file=") and "no content digest" in lines[0]
    assert any(ln.startswith("::warning") and "verified: stale" in ln for ln in lines)
    index = json.loads((zoo / "index.json").read_text())
    assert [(e["name"], e["content_sha256"], e["verification"]) for e in index["entries"]] == \
        [("a", None, None), ("b", read_metadata(b)[DIGEST_KEY], "stale")]

