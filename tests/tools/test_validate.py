"""oscar validate: every check catches its defect with one line; real and hand-made artifacts pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from factories import (
    assert_one_line_error,
    bad_clips,
    make_artifact,
    nan_k_rotation,
    oscar,
    skewed_rotation,
    tiny_model,
)

from oscar_calib.contract.artifact import (
    WEIGHTS_NAME,
    load_artifact,
)
from oscar_calib.tools.validate import (
    ModelReference,
    find_artifacts,
    validate_artifact,
    validate_paths,
)

# ----------------------------------------------------------------------------- valid artifacts

def test_demo_artifact_passes_every_check(demo_artifact):
    report = validate_artifact(demo_artifact)
    assert report.ok, report.problems
    assert set(report.checks) == {"file", "metadata", "shapes", "finite", "orthogonal", "clips", "eigenvalues",
                                  "granularity", "digest"}
    assert all(report.checks.values())
    result = oscar("validate", str(demo_artifact), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["ok"] is True and doc["artifacts"][0]["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_hand_made_artifacts_and_path_forms(tmp_path):
    a = make_artifact(tmp_path / "zoo" / "a")
    b = make_artifact(tmp_path / "zoo" / "nested" / "b", granularity="layer", seed=1)
    assert validate_artifact(a).ok and validate_artifact(b).ok
    # a directory of artifact directories, an artifact dir, and its safetensors file (deduplicated)
    found = find_artifacts([tmp_path / "zoo", a, a / WEIGHTS_NAME])
    assert [f for f, err in found] == [a / WEIGHTS_NAME, b / WEIGHTS_NAME]
    assert all(err is None for _, err in found)
    reports = validate_paths([tmp_path / "zoo"])
    assert [r.ok for r in reports] == [True, True]
    # `oscar validate zoo/*`: the zoo's index.json is skipped, any other file is a problem
    (tmp_path / "zoo" / "index.json").write_text('{"format": "oscar-zoo-index", "entries": []}')
    (tmp_path / "zoo" / "notes.json").write_text("{}")
    reports = validate_paths(sorted((tmp_path / "zoo").iterdir()))
    assert [(r.path.name, r.ok) for r in reports] == [("a", True), ("b", True), ("notes.json", False)]
    # empty directories: a problem unless --allow-empty
    (tmp_path / "empty").mkdir()
    assert not validate_paths([tmp_path / "empty"])[0].ok
    assert validate_paths([tmp_path / "empty"], allow_empty=True) == []
    result = oscar("validate", str(tmp_path / "empty"), "--allow-empty")
    assert result.exit_code == 0


def test_eigenvalue_ties_and_rounding_are_tolerated(tmp_path):
    def ties(t):
        t["layers.0.k_eigenvalues"][:] = 1.0                       # all equal: still descending
        e = t["layers.1.v_eigenvalues"]
        e[:, 3] = e[:, 2] * (1 + 1e-8)                             # float rounding above the tolerance floor
    assert validate_artifact(make_artifact(tmp_path / "a", mutate=ties)).ok


# ----------------------------------------------------------------------------- defects

def _nan(t):
    t["layers.0.v_eigenvalues"][0, 3] = float("nan")


def _ascending(t):
    t["layers.0.k_eigenvalues"][1] = t["layers.0.k_eigenvalues"][1].flip(-1)


def _drop(t):
    del t["layers.1.v_clip"]


def _reshape(t):
    t["layers.0.k_eigenvalues"] = torch.zeros(2, 4)


DEFECTS = {
    "not_orthogonal": (dict(mutate=skewed_rotation), "layers.1.k_rotation is not orthogonal"),
    "non_finite": (dict(mutate=_nan), "layers.0.v_eigenvalues has 1 non-finite value(s)"),
    "clip_range": (dict(mutate=bad_clips), "outside (0, 1]"),
    "ascending": (dict(mutate=_ascending), "layers.0.k_eigenvalues is not in descending order"),
    "missing_tensor": (dict(mutate=_drop), "missing tensor layers.1.v_clip"),
    "wrong_shape": (dict(mutate=_reshape), "layers.0.k_eigenvalues has shape [2, 4], expected [2, 8]"),
    "format_version": (dict(metadata={"format_version": "2"}), "unsupported format_version '2'"),
    "bits": (dict(metadata={"bits": "4"}), "'bits' is 4"),
    "group_size": (dict(metadata={"group_size": "3"}), "group_size 3 is not a power of two dividing head_dim 8"),
    "group_size_small": (dict(metadata={"group_size": "2"}), "group_size 2 is below the smallest group size 4"),
    "gqa": (dict(metadata={"num_attention_heads": "5"}), "5 query heads do not split evenly over 2 KV heads"),
    "fingerprint": (dict(metadata={"model_fingerprint": "abc"}), "not a sha256"),
    "layer_granularity": (dict(metadata={"granularity": "layer"}), "differs between KV heads"),
    "layer_groups_count": (dict(metadata={"layer_group_sizes": "8"}), "'layer_group_sizes' has 1 sizes for 2 layers"),
    "layer_groups_power": (dict(metadata={"layer_group_sizes": "8,3"}), "3 is not a power of two dividing head_dim 8"),
    "layer_groups_divide": (dict(metadata={"layer_group_sizes": "16,8"}), "16 is not a power of two dividing"),
    "layer_groups_syntax": (dict(metadata={"layer_group_sizes": "8;4"}), "not comma-separated integers"),
    # key centering: the means on every layer exactly when the metadata says so, finite, [kv, d]
    "k_mean_missing": (dict(centered=True, mutate=lambda t: t.pop("layers.1.k_mean")), "missing tensor layers.1.k_mean"),
    "k_mean_unflagged": (dict(centered=True, metadata={"k_centered": "false"}),
                         "layers.0.k_mean is stored but metadata 'k_centered' is not 'true'"),
    "k_mean_flag": (dict(metadata={"k_centered": "yes"}), "metadata 'k_centered' is 'yes', expected 'true' or 'false'"),
    "k_mean_nan": (dict(centered=True, mutate=lambda t: t["layers.0.k_mean"].__setitem__((1, 2), float("nan"))),
                   "layers.0.k_mean has 1 non-finite value(s)"),
    "k_mean_shape": (dict(centered=True, mutate=lambda t: t.__setitem__("layers.1.k_mean", t["layers.1.k_mean"][0])),
                     "layers.1.k_mean has shape [8], expected [2, 8]"),
    "text_config": (dict(metadata={"text_config": "gemma3"}), "expected '<wrapper model_type>.<attribute>'"),
}


@pytest.mark.parametrize("name", sorted(DEFECTS))
def test_each_defect_is_reported(tmp_path, name):
    kwargs, expected = DEFECTS[name]
    art = make_artifact(tmp_path / name, **kwargs)
    report = validate_artifact(art)
    assert not report.ok
    assert any(expected in p for p in report.problems), report.problems
    if name == "clip_range":
        assert len(report.problems) == 2          # one line per bad tensor


def _truncate(p: Path):
    data = p.read_bytes()
    p.write_bytes(data[:-100])


def _garble_header(p: Path):
    data = bytearray(p.read_bytes())
    data[8:40] = b"\x00\xff" * 16
    p.write_bytes(bytes(data))


def _tiny_file(p: Path):
    p.write_bytes(b"\x01\x02")


def _huge_header_length(p: Path):
    data = bytearray(p.read_bytes())
    data[:8] = (10 ** 9).to_bytes(8, "little")
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,expected", [
    (_truncate, "truncated file: tensor data needs"),
    (_garble_header, "corrupt safetensors header"),
    (_tiny_file, "truncated file (2 bytes)"),
    (_huge_header_length, "truncated or corrupt safetensors file"),
])
def test_damaged_files_give_one_clear_line(tmp_path, damage, expected):
    art = make_artifact(tmp_path / "a")
    damage(art / WEIGHTS_NAME)
    report = validate_artifact(art)
    assert report.problems == [p for p in report.problems if expected in p] and len(report.problems) == 1
    result = oscar("validate", str(art))
    assert result.exit_code == 1
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{art}: ") and expected in lines[0]


def test_cli_reports_every_problem_of_every_artifact(tmp_path):
    good = make_artifact(tmp_path / "good")
    bad = make_artifact(tmp_path / "bad", mutate=bad_clips)
    result = oscar("validate", str(good), str(bad), str(tmp_path / "missing"), "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert [a["ok"] for a in doc["artifacts"]] == [True, False, False]
    assert len(doc["artifacts"][1]["problems"]) == 2 and doc["artifacts"][1]["checks"]["clips"] is False
    assert doc["artifacts"][2]["problems"] == ["no such file or directory"]


def test_model_check_matches_and_mismatches(demo_artifact, smollm2):
    model, _, src = smollm2
    ref = ModelReference.from_model(model, "smollm2-135m", src.model_id)
    report = validate_artifact(demo_artifact, model=ref)
    assert report.ok and report.checks["model"] is True
    other = ModelReference.from_model(tiny_model("llama"), "tiny-llama")
    report = validate_artifact(demo_artifact, model=other)
    assert report.checks["model"] is False
    assert any("num_layers is 30 but tiny-llama has 2" in p for p in report.problems)
    assert any("model fingerprint" in p and "does not match tiny-llama" in p for p in report.problems)


def test_exit_code_and_no_traceback(tmp_path):
    """(The console script's own exit codes, as a process: tests/cli/test_cli.py.)"""
    art = make_artifact(tmp_path / "a")
    _truncate(art / WEIGHTS_NAME)
    code, _, err = oscar("validate", art)
    assert code == 1
    assert "Traceback" not in err and "truncated file" in err
    # load_artifact agrees that the file is unusable, with a typed error
    from oscar_calib.errors import ArtifactError

    with pytest.raises(ArtifactError):
        load_artifact(art)


# ----------------------------------------------------------------------------- every reader validates

@pytest.mark.parametrize("defect, line", [(nan_k_rotation, "layers.1.k_rotation has 1 non-finite value(s)"),
                                          (skewed_rotation, "layers.1.k_rotation is not orthogonal")])
def test_every_reader_refuses_an_invalid_artifact_before_using_it(tmp_path, defect, line):
    """Eval, verify, fold-weights, export, the runtime caches and KVScheme (from a
    path) refuse a NaN or a non-orthogonal rotation with the validator's line, before any model is
    loaded (the model named here does not exist) and before anything is written."""
    from oscar_calib.errors import ArtifactError
    from oscar_calib.eval import EvalOptions, run_eval
    from oscar_calib.eval.verify import verify_artifact
    from oscar_calib.runtime import OscarCache, SimulatedCache
    from oscar_calib.runtime.scheme import KVScheme
    from oscar_calib.tools.export.sglang import export_sglang
    from oscar_calib.tools.fold import fold_checkpoint

    bad = make_artifact(tmp_path / "bad", mutate=defect)
    assert validate_artifact(bad).problems[0].startswith(line)
    nowhere = "no-such-org/no-such-model"
    model = type("M", (), {"config": None})()            # never reached
    readers = {
        "load_artifact": lambda: load_artifact(bad),
        "verify": lambda: verify_artifact(bad, model=nowhere, backend="torch"),
        "eval": lambda: run_eval(nowhere, bad, EvalOptions(methods="bf16,oscar")),
        "fold-weights": lambda: fold_checkpoint(nowhere, bad, tmp_path / "folded"),
        "export": lambda: export_sglang(bad, tmp_path / "exported", clip=(0.9, 0.9)),
        "OscarCache": lambda: OscarCache.from_artifact(bad, model),
        "SimulatedCache": lambda: SimulatedCache.from_artifact(bad, model),
        "KVScheme": lambda: KVScheme.from_artifact(bad),
        "KVScheme.shared": lambda: KVScheme.shared_from_artifact(bad, clips=(0.9, 0.9)),
    }
    for name, read in readers.items():
        with pytest.raises(ArtifactError) as exc:
            read()
        assert line in str(exc.value), (name, str(exc.value))
    for args in (["eval", nowhere, str(bad)], ["verify", str(bad), "--model", nowhere],
                 ["fold-weights", nowhere, str(bad), "--out", str(tmp_path / "folded")],
                 ["export", str(bad), "--out", str(tmp_path / "exported")]):
        result = oscar(*args)
        assert_one_line_error(result.exit_code, result.stderr, f"{bad}: {line}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]              # nothing written
    assert not (bad / "verify.json").exists()
