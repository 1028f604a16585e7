"""Per-layer group sizes in the artifact (``layer_group_sizes``, a bit budget): round trip through
the file, the scheme and the real caches read them, old artifacts still read, refusals in one line."""

from __future__ import annotations

import pytest
import torch
from factories import make_artifact, tiny_model

from oscar_calib.contract.artifact import load_artifact
from oscar_calib.errors import ArtifactError
from oscar_calib.model.geometry import geometry_of
from oscar_calib.runtime import OscarCache, SimulatedCache
from oscar_calib.runtime.scheme import KVScheme
from oscar_calib.tools.validate import validate_artifact


def test_round_trip_and_the_scheme_reads_per_layer_sizes(tmp_path):
    path = make_artifact(tmp_path / "a", layers=3, d=16, metadata={"layer_group_sizes": "16,4,8", "group_size": "8"})
    assert validate_artifact(path).ok
    art = load_artifact(path)
    assert art.settings.k_groups == [16, 4, 8] and art.group_size == 8
    sch = KVScheme.from_artifact(art)
    assert sch.k_groups == [16, 4, 8] and sch.v_groups == [16, 4, 8] and sch.group_size == 8
    assert sch.bits_per_element == pytest.approx((2 + 32 / 16 + 2 + 32 / 4 + 2 + 32 / 8) / 3)
    forced = KVScheme.from_artifact(art, group_size=16)          # an explicit size still wins, everywhere
    assert forced.k_groups == [16] * 3 and forced.uniform_groups


def test_key_and_value_sizes_round_trip_and_validate(tmp_path):
    """``layer_v_group_sizes``: the values' sizes beside the keys' (``layer_group_sizes``, or
    ``group_size`` without it); the scheme reads both, a bad list is refused by every reader."""
    path = make_artifact(tmp_path / "s", layers=3, d=16, metadata={"layer_group_sizes": "4,4,8",
                                                                   "layer_v_group_sizes": "16,8,8", "group_size": "8"})
    assert validate_artifact(path).ok
    art = load_artifact(path)
    assert list(art.layer_groups) == [(4, 16), (4, 8), (8, 8)]
    sch = KVScheme.from_artifact(art)
    assert sch.k_groups == [4, 4, 8] and sch.v_groups == [16, 8, 8] and not sch.uniform_groups
    assert sch.bits_per_element == pytest.approx(sum(2 + 32 / g for g in (4, 4, 8, 16, 8, 8)) / 6)
    only_v = load_artifact(make_artifact(tmp_path / "v", layers=2, d=16, metadata={"layer_v_group_sizes": "16,4"}))
    assert list(only_v.layer_groups) == [(16, 16), (16, 4)]
    bad = make_artifact(tmp_path / "bad", layers=2, d=16, metadata={"layer_v_group_sizes": "16,6"})
    res = validate_artifact(bad)
    assert not res.ok and any("layer_v_group_sizes" in p and "6 is not a power of two" in p
                              for p in res.problems)
    with pytest.raises(ArtifactError, match="'layer_v_group_sizes': 6 is not a power of two"):
        load_artifact(bad)
    short = make_artifact(tmp_path / "short", layers=2, d=16, metadata={"layer_v_group_sizes": "16"})
    with pytest.raises(ArtifactError, match="'layer_v_group_sizes' has 1 sizes for 2 layers"):
        load_artifact(short)


def test_old_artifacts_read_as_one_size(tmp_path):
    art = load_artifact(make_artifact(tmp_path / "old", layers=2, d=16))
    assert "layer_group_sizes" not in art.metadata
    assert art.settings.k_groups == [16, 16]
    assert KVScheme.from_artifact(art).uniform_groups


def test_real_cache_and_simulations_store_each_layer_with_its_size():
    """Per-layer sizes, K = V within a layer or K and V apart: the real cache, the decode simulation
    and the perplexity simulation read the same values (float32 window), and differ from one uniform
    size."""
    from runtime.test_runtime_cache import step_logits

    from oscar_calib.runtime.simulate import SimulatedKV

    m = tiny_model("llama", layers=2)
    geo = geometry_of(m)
    d, h = geo.head_dim, geo.num_kv_heads
    g = torch.Generator().manual_seed(0)
    rot = [torch.linalg.qr(torch.randn(h, d, d, generator=g, dtype=torch.float64))[0].float() for _ in range(2)]
    clips = dict(k_clip=[torch.full((h,), 0.95)] * 2, v_clip=[torch.full((h,), 0.9)] * 2)

    def make(sizes):
        return KVScheme("b", 2, d, rot, rot, sink=2, recent=3, window_dtype=None, k_groups=sizes,
                        v_groups=list(sizes), **clips)

    ids = torch.randint(1, 120, (1, 30), generator=torch.Generator().manual_seed(4))
    sch = make([d, d // 4])
    real = step_logits(m, OscarCache(m.config, sch), ids, 1)      # token by token: what the ppl path reads
    sim = step_logits(m, SimulatedCache(m.config, sch), ids, 1)
    with torch.no_grad(), SimulatedKV(m, sch):
        ppl_path = m(ids).logits
    assert (real - sim).abs().max() < 1e-4 and (ppl_path - sim).abs().max() < 1e-4
    uniform = step_logits(m, SimulatedCache(m.config, make([d, d])), ids, 1)
    assert (uniform - sim).abs().max() > 1e-3
    # keys and values in groups of different sizes (layer 0: K smaller, layer 1: V smaller): the same
    # agreement, and a different result from the tied sizes
    split = KVScheme("s", 2, d, rot, rot, sink=2, recent=3, window_dtype=None, k_groups=[d // 4, d],
                     v_groups=[d, d // 2], **clips)
    real = step_logits(m, OscarCache(m.config, split), ids, 1)
    sim = step_logits(m, SimulatedCache(m.config, split), ids, 1)
    with torch.no_grad(), SimulatedKV(m, split):
        ppl_path = m(ids).logits
    assert (real - sim).abs().max() < 1e-4 and (ppl_path - sim).abs().max() < 1e-4
    tied = step_logits(m, SimulatedCache(m.config, make([d // 4, d])), ids, 1)
    assert (tied - sim).abs().max() > 1e-3


def test_a_bad_layer_group_list_is_refused_by_every_reader(tmp_path):
    bad = make_artifact(tmp_path / "bad", layers=2, d=8, metadata={"layer_group_sizes": "8,3"})
    with pytest.raises(ArtifactError, match="3 is not a power of two dividing head_dim 8"):
        load_artifact(bad)
    with pytest.raises(ArtifactError, match="3 is not a power of two"):
        KVScheme.from_artifact(bad)


def test_eval_reads_a_bit_budget_artifact_end_to_end(tiny_bit_budget):
    """calibrate --bit-budget on a tiny model, then `oscar eval`'s ppl: the oscar row runs each layer at
    its size (bits = the per-layer mean), the baselines at the artifact's uniform size; an explicit
    --group-size still means one size everywhere."""
    from factories import loaded_tiny

    from oscar_calib.eval import EvalOptions
    from oscar_calib.eval.ppl import evaluate_ppl
    from oscar_calib.eval.report import eval_text, group_label

    lm = loaded_tiny("llama", head_dim=64, layers=3)        # the model tiny_bit_budget calibrated
    art = tiny_bit_budget.artifact
    sizes = art.settings.k_groups
    assert sorted(sizes) == [32, 64, 64]
    opts = EvalOptions(methods=("bf16", "hadamard", "oscar"), sink=4, recent=8, sequences=1, seq_len=48)
    res = evaluate_ppl(lm, opts, artifact=art)
    by = {r["method"]: r for r in res.rows}
    assert by["oscar"]["layer_group_sizes"] == [[g, g] for g in sizes]
    assert by["oscar"]["bits_per_element"] == pytest.approx((3 + 2.5 + 2.5) / 3)
    assert by["hadamard"]["bits_per_element"] == 2.5 and "layer_group_sizes" not in by["hadamard"]
    assert group_label(by["oscar"]) == "32-64" and "32-64" in eval_text({"ppl": res.to_json()})
    forced = evaluate_ppl(lm, EvalOptions(methods=("oscar",), group_size=64, sink=4, recent=8, sequences=1,
                                          seq_len=48), artifact=art)
    assert "layer_group_sizes" not in forced.rows[0] and forced.rows[0]["ppl"] != by["oscar"]["ppl"]
