"""Every export target declares, as data, which artifact settings its engine serves; the base class
names every other setting the artifact uses in one warning (or refuses), the same way for every
target: no target overrides the checks, and no setting is dropped in silence."""

from __future__ import annotations

import json

import pytest
from factories import make_artifact
from test_export_engines import write_gguf

from oscar_calib.contract.artifact import load_artifact
from oscar_calib.contract.features import FEATURES, feature_lines
from oscar_calib.tools.export import TARGETS, ExportSettings, export_artifact
from oscar_calib.tools.export.base import ExportTarget

# every optional setting at once: per-layer key sizes, values apart, the logit-noise correction, key centering,
# windows; head_dim 128 so that every engine's shape rules hold (llama.cpp's q2_0 blocks of 128)
EVERYTHING = {"group_size": "64", "layer_group_sizes": "32,64", "layer_v_group_sizes": "128,64",
              "logit_correction": "0.5", "fork_k_clip": "0.96", "fork_v_clip": "0.92", "model_type": "qwen3"}


@pytest.fixture(scope="module")
def everything(tmp_path_factory):
    root = tmp_path_factory.mktemp("settings")
    art = make_artifact(root / "art", layers=2, kv=2, heads=4, d=128, granularity="layer", metadata=EVERYTHING,
                        centered=True)
    gguf = write_gguf(root / "m.gguf", arch="qwen3", layers=2, heads=4, kv=2, d=128)
    return art, gguf


def test_no_target_overrides_the_checks():
    assert all(type(t).export is ExportTarget.export for t in TARGETS.values())
    assert all(t.serves <= set(FEATURES) for t in TARGETS.values())


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_each_dropped_setting_is_named_in_one_line(tmp_path, everything, name):
    path, gguf = everything
    target = TARGETS[name]
    art = load_artifact(path)
    s = ExportSettings(gguf=gguf)
    res = export_artifact(path, tmp_path / name, name, s)
    want, refused = target.setting_lines(art, s)
    assert not refused
    active = [f for f in FEATURES.values() if f.active(art.settings)]
    dropped = [f for f in active if f.name not in target.serves]
    # one line per dropped setting (a split dropped with the per-layer sizes is said by their line)
    covered = [f for f in dropped if f.covered_by and f.covered_by in {d.name for d in dropped}]
    assert len(want) == len(dropped) - len(covered) and all("\n" not in w for w in want)
    assert res.warnings[:len(want)] == want
    for f in dropped:
        line = target.feature_wording(f.name, art, s) or f.dropped(art.settings, target.engine)
        assert (line in want) != (f in covered), (name, f.name)
    record = tmp_path / name / "settings.json"
    if record.exists():
        assert json.loads(record.read_text())["warnings"] == res.warnings
    env = tmp_path / name / "serve.env"
    if env.exists():                                  # engines with a command line carry them into serve.env
        text = env.read_text()
        assert all(f"# WARNING: {w}" in text for w in want)


def test_the_two_settings_that_were_dropped_in_silence(tmp_path, everything):
    path, _ = everything
    fork = export_artifact(path, tmp_path / "fork", "sglang-fork", ExportSettings())
    assert any("does not subtract the logit-noise correction" in w and "0.5" in w for w in fork.warnings)
    assert any("logit-noise correction" in line for line in (tmp_path / "fork" / "serve.env").read_text().splitlines()
               if line.startswith("# WARNING"))
    ort = export_artifact(path, tmp_path / "ort", "onnxruntime", ExportSettings())
    assert any("values are stored in the keys' groups (32–64) instead of their own (64–128)" in w
               for w in ort.warnings)


def test_key_centering_is_served_by_the_forks_newer_code_only(tmp_path, everything):
    """Every target but sglang-fork-v2 names the key mean it does not subtract, saying what it serves
    without it; sglang-fork-v2 writes it."""
    path, gguf = everything
    art = load_artifact(path)
    line = FEATURES["key_centering"].dropped(art.settings, "X").removeprefix("X ")
    assert "serves the rotations and clips on uncentered keys" in line
    for name, target in TARGETS.items():
        warnings, _ = target.setting_lines(art, ExportSettings(gguf=gguf))
        said = [w for w in warnings if "k_mean" in w]
        assert said == ([] if name == "sglang-fork-v2" else [f"{target.engine} {line}"]), name
    assert {n for n, t in TARGETS.items() if "key_centering" in t.serves} == {"sglang-fork-v2"}


def test_an_artifact_without_optional_settings_gets_no_setting_lines(tmp_path):
    plain = load_artifact(make_artifact(tmp_path / "p", layers=2, kv=1, heads=2, d=128, granularity="layer",
                                        metadata={"fork_k_clip": "0.96", "fork_v_clip": "0.92"}))
    for t in TARGETS.values():
        warnings, refusals = t.setting_lines(plain, ExportSettings())
        assert refusals == [] and [w for w in warnings if "window" not in w] == [], t.name
    # the windows are the one setting vLLM's revision drops even for a plain artifact
    assert feature_lines(plain.settings, TARGETS["vllm"].serves, "vLLM")[0]
