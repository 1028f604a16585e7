"""A hybrid model's attention layers and per-layer head sizes in the artifact contract: the settings
``layer_ids`` / ``layer_head_dims`` / ``layer_kv_heads`` (validated once, written only where they say
something), the per-layer shape checks every reader runs, the artifact-matches-model check on the
attention layers only, and the one-line refusals of engines that cannot honour them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from factories import build_artifact, family_model, make_artifact

from oscar_calib.contract.artifact import (
    compatibility_problems,
    load_artifact,
    require_compatible,
)
from oscar_calib.contract.features import FEATURES, feature_lines
from oscar_calib.contract.layout import (
    LAYER_HEAD_DIMS_METADATA,
    LAYER_IDS_METADATA,
    LAYER_KV_HEADS_METADATA,
)
from oscar_calib.contract.settings import ArtifactSettings
from oscar_calib.errors import ArtifactError
from oscar_calib.model.geometry import geometry_of, model_fingerprint
from oscar_calib.tools.validate import validate_artifact

BASE = dict(num_layers=3, num_attention_heads=4, num_kv_heads=2, head_dim=16, group_size=8, sink_tokens=64,
            recent_tokens=256)


def test_layer_ids_and_head_sizes_round_trip_and_default_to_the_uniform_model():
    s = ArtifactSettings(**BASE, layer_ids=(3, 7, 11), layer_head_dims=(16, 16, 32), layer_kv_heads=(2, 2, 1))
    md = s.metadata()
    assert (md[LAYER_IDS_METADATA], md[LAYER_HEAD_DIMS_METADATA], md[LAYER_KV_HEADS_METADATA]) == \
        ("3,7,11", "16,16,32", "2,2,1")
    assert ArtifactSettings.from_metadata(md) == s and s.mapped_layers and s.mixed_heads and s.hybrid
    assert s.layer_heads(2) == (1, 32)
    plain = ArtifactSettings(**BASE)
    assert not {LAYER_IDS_METADATA, LAYER_HEAD_DIMS_METADATA, LAYER_KV_HEADS_METADATA} & set(plain.metadata())
    assert plain.layer_ids == (0, 1, 2) and plain.layer_head_dims == (16,) * 3 and not plain.mapped_layers
    # every layer attention but a recurrent state beside it (Falcon-H1): hybrid, nothing to map
    assert ArtifactSettings(**BASE, model_type="falcon_h1").hybrid


@pytest.mark.parametrize("change, line", [
    (dict(layer_ids=(3, 3, 7)), "'layer_ids' must be increasing decoder-layer indices, got 3,3,7"),
    (dict(layer_ids=(1, 2)), "'layer_ids' has 2 ids for 3 layers"),
    (dict(layer_ids=(1, 2, 5000)), "names layer 5000, above the toolkit's limit of 1023"),
    (dict(layer_head_dims=(32, 16, 16)), "'layer_head_dims' starts with 32 but head_dim (layer 0's) is 16"),
    (dict(layer_head_dims=(16, 16, 18)), "head_dim 18 is not a multiple of 4"),
    (dict(layer_head_dims=(16, 16, 4)), "group_size 8 is not a power of two dividing head_dim 4"),
    (dict(layer_kv_heads=(2, 2, 3)), "4 query heads do not split evenly over 3 KV heads"),
    (dict(layer_kv_heads=(2, 2, 0)), "'layer_kv_heads' must hold values in 1..1024"),
])
def test_bad_per_layer_settings_are_refused_on_write_and_on_read(change, line):
    with pytest.raises(ArtifactError, match=line.replace("(", r"\(").replace(")", r"\)")):
        ArtifactSettings(**BASE, **change)
    md = ArtifactSettings(**BASE).metadata()
    md.update({k: ",".join(map(str, v)) for k, v in change.items()})
    _, problems = ArtifactSettings.read(md)
    assert any(line in p for p in problems), problems


def test_shape_checks_follow_each_layers_heads(tmp_path):
    """A Gemma 4 artifact: every reader takes layer i's tensors at its own KV heads and head_dim, and
    names the one that does not match."""
    model = family_model("gemma4")
    geo = geometry_of(model)
    assert geo.head_dims == (16, 16, 32) and geo.kv_heads == (2, 2, 1)
    out = make_artifact(tmp_path / "ok", model)
    art = load_artifact(out)
    assert [tuple(lr.k_rotation.shape) for lr in art.layers] == [(2, 16, 16), (2, 16, 16), (1, 32, 32)]

    def shrink(t):
        t["layers.2.v_clip"] = torch.ones(2)

    bad = make_artifact(tmp_path / "bad", model, mutate=shrink)
    report = validate_artifact(bad)
    assert report.problems == ["layers.2.v_clip has shape [2], expected [1]"]
    # metadata that says one head geometry for every layer: the rotations of layer 2 contradict it
    legacy = make_artifact(tmp_path / "legacy", model, metadata={LAYER_HEAD_DIMS_METADATA: "16,16,16",
                                                                 LAYER_KV_HEADS_METADATA: "2,2,2"})
    assert "layers.2.k_rotation has shape [1, 32, 32], expected [2, 16, 16]" in validate_artifact(legacy).problems


def test_compatibility_compares_the_attention_layers_only():
    """A Qwen3.5 stand-in (linear, full, linear, full): its artifact's two layers are decoder layers
    1 and 3; the linear-attention layers' weights are not in the fingerprint; an artifact whose
    layers map elsewhere, or of other head sizes, is refused in one line."""
    model = family_model("qwen3_5_text")
    geo = geometry_of(model)
    assert (geo.num_layers, geo.layer_ids) == (2, (1, 3))
    art = build_artifact(model)
    assert art.metadata[LAYER_IDS_METADATA] == "1,3" and art.settings.layer_ids == (1, 3)
    require_compatible(art, geo, model_fingerprint(model))
    with torch.no_grad():                   # the recurrent layers' weights are not the artifact's business
        model.model.layers[0].linear_attn.in_proj_qkv.weight.mul_(2)
    require_compatible(art, geo, model_fingerprint(model))
    moved = dict(art.metadata, **{LAYER_IDS_METADATA: "0,2"})
    assert compatibility_problems(moved, geo, None) == [
        "the artifact's layers have the model's layers 0, 2 but this model's attention layers have 1, 3"]
    unmapped = {k: v for k, v in art.metadata.items() if k != LAYER_IDS_METADATA}
    assert "have the model's layers 0, 1" in compatibility_problems(unmapped, geo, None)[0]
    gemma = geometry_of(family_model("gemma4_text"))
    flat = dict(build_artifact(family_model("gemma4_text")).metadata)
    flat.pop(LAYER_HEAD_DIMS_METADATA)
    assert compatibility_problems(flat, gemma, None) == [
        "the artifact's layers have head_dims 16, 16, 16 but this model's attention layers have 16, 16, 32"]


def test_engines_that_cannot_map_or_size_the_layers_refuse_in_one_line():
    s = ArtifactSettings(**BASE, layer_ids=(3, 7, 11))
    warnings, refusals = feature_lines(s, {"windows", "per_head_rotations"}, "EngineX")
    assert warnings == [] and refusals == [
        "the artifact's 3 layers are the model's attention layers 3, 7, 11 (a hybrid model), and EngineX was not "
        "read to load rotations by the model's layer ids, so it could put them on the wrong layers"]
    assert feature_lines(s, {"windows", "per_head_rotations", "layer_ids"}, "EngineX") == ([], [])
    mixed = dataclasses.replace(ArtifactSettings(**BASE), layer_head_dims=(16, 16, 32), layer_kv_heads=(2, 2, 1))
    _, refusals = feature_lines(mixed, {"windows", "per_head_rotations"}, "EngineX")
    assert refusals == ["the model's layers differ in head geometry (2 x (2 KV heads of 16), 1 x (1 KV heads of 32)), "
                        "and EngineX loads one head_dim and KV-head count for every layer"]
    assert FEATURES["layer_ids"].refused and FEATURES["layer_head_dims"].refused
