"""The artifact's typed settings (contract.settings): parsed once where an artifact is read, rendered
by the same object where one is written, and every rule in one place (the group size, the logit
correction's range, "V takes K's group size")."""

from __future__ import annotations

import dataclasses

import pytest
from factories import build_artifact, make_artifact

from oscar_calib.contract import settings as settings_mod
from oscar_calib.contract.artifact import Artifact, load_artifact
from oscar_calib.contract.defaults import (
    check_group_size,
    group_pair,
    group_size_problem,
)
from oscar_calib.contract.features import FEATURES, feature_lines
from oscar_calib.contract.layout import LAYER_GROUPS_METADATA, LAYER_V_GROUPS_METADATA
from oscar_calib.contract.settings import ArtifactSettings, GroupPair
from oscar_calib.errors import ArtifactError, InputError

BASE = dict(num_layers=3, num_attention_heads=4, num_kv_heads=2, head_dim=16, group_size=8, sink_tokens=64,
            recent_tokens=256)


def test_settings_round_trip_through_metadata():
    s = ArtifactSettings(**BASE, layer_groups=((4, 16), (8, 8), (8, 4)), logit_correction=0.5, v_folded=True,
                         shared_clips=(0.9, 0.8), model_type="llama", granularity="layer", composition="u_h_pbr",
                         k_objective="ktk", v_objective="sst")
    md = s.metadata()
    assert md[LAYER_GROUPS_METADATA] == "4,8,8" and md[LAYER_V_GROUPS_METADATA] == "16,8,4"
    assert md["logit_correction"] == "0.5" and md["v_folded"] == "true" and md["fork_k_clip"] == "0.9"
    again = ArtifactSettings.from_metadata(md)
    assert again == s and again.metadata() == md
    assert again.layer_groups[0] == GroupPair(4, 16) and again.layer_groups[0].split and again.split_groups


def test_optional_keys_are_written_only_when_they_say_something():
    md = ArtifactSettings(**BASE).metadata()
    assert not {LAYER_GROUPS_METADATA, LAYER_V_GROUPS_METADATA, "logit_correction", "v_folded", "fork_k_clip"} & set(md)
    s = ArtifactSettings.from_metadata(md)
    assert s.k_groups == s.v_groups == [8, 8, 8] and s.uniform_groups and s.logit_correction == 0.0
    # values apart from one uniform key size: only the values' list is stored
    split = ArtifactSettings(**BASE, layer_groups=((8, 16),) * 3).metadata()
    assert LAYER_GROUPS_METADATA not in split and split[LAYER_V_GROUPS_METADATA] == "16,16,16"


@pytest.mark.parametrize("change, line", [
    (dict(group_size=2), "group_size 2 is below the smallest group size 4"),
    (dict(group_size=24), "group_size 24 is not a power of two dividing head_dim 16"),
    (dict(layer_groups=((4, 4), (4, 3), (4, 4))), "'layer_v_group_sizes': 3 is not a power of two"),
    (dict(logit_correction=5.0), "must be a number in [0, 4]"),
    (dict(num_attention_heads=5), "5 query heads do not split evenly over 2 KV heads"),
    (dict(granularity="tensor"), "unknown granularity 'tensor'"),
    (dict(shared_clips=(0.9, 1.5)), "metadata 'fork_v_clip' is 1.5, expected a clip ratio in (0, 1]"),
])
def test_a_writer_cannot_build_what_a_reader_refuses(change, line):
    with pytest.raises(ArtifactError, match=line.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        ArtifactSettings(**{**BASE, **change})
    # and the reader refuses the same metadata with the same line
    good = ArtifactSettings(**BASE).metadata()
    bad = {**good, **{k: v for k, v in _as_metadata(change).items()}}
    _, problems = ArtifactSettings.read(bad)
    assert any(line in p for p in problems), problems


def _as_metadata(change: dict) -> dict:
    out = {}
    for k, v in change.items():
        if k == "layer_groups":
            out[LAYER_GROUPS_METADATA] = ",".join(str(g[0]) for g in v)
            out[LAYER_V_GROUPS_METADATA] = ",".join(str(g[1]) for g in v)
        elif k == "shared_clips":
            out.update(fork_k_clip=str(v[0]), fork_v_clip=str(v[1]))
        else:
            out[k] = str(v)
    return out


def test_every_problem_is_collected_for_validate():
    md = {**ArtifactSettings(**BASE).metadata(), "group_size": "3", "logit_correction": "x", "v_folded": "yes",
          LAYER_V_GROUPS_METADATA: "4,4"}
    _, problems = ArtifactSettings.read(md)
    assert len(problems) == 3 and "'layer_v_group_sizes' has 2 sizes for 3 layers" in problems[0]
    assert "logit_correction" in problems[1] and "'v_folded' is 'yes'" in problems[2]


def test_one_group_size_rule_everywhere():
    assert group_size_problem(2) and group_size_problem(4) is None and group_size_problem(3)
    assert group_size_problem(32, 16) and group_size_problem(True) and group_size_problem(16, 16) is None
    with pytest.raises(InputError, match="--group-size 2 is below the smallest group size 4"):
        check_group_size(None, 2, "--group-size")
    assert group_pair(32) == (32, 32) and group_pair(32, 128) == (32, 128) == GroupPair.of(32, 128)


def test_an_artifact_read_parses_its_settings_once(tmp_path, monkeypatch):
    """load_artifact parses the settings while checking the bytes and hands them to the Artifact;
    the scheme, the runtime's check and the exports ask the typed object, never the strings."""
    from oscar_calib.runtime.scheme import KVScheme
    from oscar_calib.tools.export import ExportSettings, get_target

    path = make_artifact(tmp_path / "a", d=16, metadata={"fork_k_clip": "0.96", "fork_v_clip": "0.92",
                                                         LAYER_GROUPS_METADATA: "8,16", "logit_correction": "0.5"})
    calls = []
    real = ArtifactSettings.read.__func__
    monkeypatch.setattr(ArtifactSettings, "read", classmethod(lambda cls, md: calls.append(1) or real(cls, md)))
    art = load_artifact(path)
    assert len(calls) == 1
    sch = KVScheme.from_artifact(art)
    assert sch.k_groups == [8, 16] and sch.logit_correction == 0.5
    assert art.settings.shared_clips == (0.96, 0.92)
    get_target("onnxruntime").setting_lines(art, ExportSettings())
    assert len(calls) == 1


def test_key_centering_is_one_flag_written_only_when_on():
    on = ArtifactSettings(**BASE, key_centering=True)
    assert on.metadata()["k_centered"] == "true" and ArtifactSettings.from_metadata(on.metadata()) == on
    assert "k_centered" not in ArtifactSettings(**BASE).metadata()
    _, problems = ArtifactSettings.read({**on.metadata(), "k_centered": "1"})
    assert problems == ["metadata 'k_centered' is '1', expected 'true' or 'false'"]


def test_key_centering_records_what_it_was_fitted_on():
    """``key_center_fit`` is written with ``k_centered`` when it is ``raw``; a file without it (the
    default, or written before the setting) reads as ``centered``; a fit without centering, or an unknown one, is
    refused; an engine that does not subtract ``k_mean`` is told what it then serves."""
    raw = ArtifactSettings(**BASE, key_centering=True, key_center_fit="raw")
    md = raw.metadata()
    assert md["k_center_fit"] == "raw" and ArtifactSettings.from_metadata(md) == raw
    assert "k_center_fit" not in ArtifactSettings(**BASE, key_centering=True).metadata()     # the default: absent
    assert "k_center_fit" not in ArtifactSettings(**BASE).metadata()
    old = {k: v for k, v in md.items() if k != "k_center_fit"}
    assert ArtifactSettings.from_metadata(old).key_center_fit == "centered"
    assert ArtifactSettings.read({**md, "k_center_fit": "mean"})[1] == [
        "metadata 'k_center_fit' is 'mean', expected one of centered, raw"]
    plain = {k: v for k, v in md.items() if k != "k_centered"}
    assert ArtifactSettings.read(plain)[1] == [
        "metadata 'k_center_fit' is 'raw' but the keys are not centered ('k_centered' is not 'true')"]
    with pytest.raises(ArtifactError, match="k_center_fit"):
        ArtifactSettings(**BASE, key_center_fit="raw")
    warnings, _ = feature_lines(raw, {"windows", "per_head_rotations"}, "engine W")
    assert warnings == ["engine W does not subtract the mean key (k_mean) this artifact was calibrated with: it "
                        "serves the rotations, clips and group sizes on uncentered keys, as they were fitted "
                        "(center_fit raw), without what centering gains"]


def test_an_artifact_in_memory_holds_its_key_means_exactly_when_its_settings_say_so():
    art = build_artifact(centered=True)
    assert art.settings.key_centering and all(lr.k_mean.shape == (2, 8) for lr in art.layers)
    assert set(art.tensors()) >= {"layers.0.k_mean", "layers.1.k_mean"}
    with pytest.raises(ArtifactError, match="2 of 2 layers hold a key mean .* key_centering=False"):
        dataclasses.replace(art, settings=None, metadata={k: v for k, v in art.metadata.items() if k != "k_centered"})
    art.layers[1].k_mean = None
    with pytest.raises(ArtifactError, match="1 of 2 layers hold a key mean"):
        dataclasses.replace(art)


def test_an_artifact_in_memory_is_refused_with_bad_settings():
    with pytest.raises(ArtifactError, match="group_size 3 is not a power of two"):
        build_artifact(metadata={"group_size": "3"})
    art = build_artifact()
    assert isinstance(art, Artifact) and art.settings.group_size == 8
    with pytest.raises(ArtifactError, match="below the smallest group size"):
        dataclasses.replace(art, settings=None, metadata={**art.metadata, "group_size": "2"})


def test_feature_lines_name_each_dropped_setting_once():
    s = ArtifactSettings(**BASE, layer_groups=((4, 16), (8, 8), (8, 8)), logit_correction=0.5)
    warnings, refusals = feature_lines(s, set(), "engine X")
    assert not refusals
    assert any("logit-noise correction" in w for w in warnings)
    # per-layer sizes and the K/V split both dropped: one line says both
    groups = [w for w in warnings if "group" in w]
    assert len(groups) == 1 and "the keys' per-layer sizes 4–8 and the values' 8–16" in groups[0]
    # an engine that serves per-layer sizes but one size per layer for K and V: the split's own line
    warnings, _ = feature_lines(s, {"layer_group_sizes", "logit_correction", "windows", "per_head_rotations"},
                                "engine Y")
    assert warnings == ["engine Y takes one group size per layer for K and V: the values are stored in the keys' "
                        "groups (4–8) instead of their own (8–16)"]
    assert feature_lines(s, set(FEATURES), "engine Z") == ([], [])
    centered = ArtifactSettings(**BASE, key_centering=True)
    warnings, refusals = feature_lines(centered, {"windows", "per_head_rotations"}, "engine W")
    assert not refusals and warnings == [
        "engine W does not subtract the mean key (k_mean) this artifact was calibrated with: it serves the rotations "
        "and clips on uncentered keys, whose INT2 groups span a wider range than the clips were fitted for"]
    assert feature_lines(centered, {"windows", "per_head_rotations", "key_centering"}, "engine V") == ([], [])
    with pytest.raises(InputError, match="unknown artifact feature"):
        feature_lines(s, {"typo"}, "engine")


def test_the_settings_module_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys; import oscar_calib.contract.settings as m; "
            "assert 'torch' not in sys.modules, 'torch imported'; print(m.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert settings_mod.__name__ in out.stdout
