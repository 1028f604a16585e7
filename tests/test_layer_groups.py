"""Per-layer group sizes in the artifact (``layer_group_sizes``, a bit budget): round trip through
the file, the scheme and the real caches read them, old artifacts still read, refusals in one line."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model
from test_validate import make_artifact

from oscar_calib.errors import ArtifactError, InputError
from oscar_calib.model.geometry import geometry_of
from oscar_calib.runtime import OscarCache, SimulatedCache
from oscar_calib.runtime.scheme import KVScheme
from oscar_calib.spec.artifact import load_artifact
from oscar_calib.tools.validate import validate_artifact


def test_round_trip_and_the_scheme_reads_per_layer_sizes(tmp_path):
    path = make_artifact(tmp_path / "a", layers=3, d=16, metadata={"layer_group_sizes": "16,4,8", "group_size": "8"})
    assert validate_artifact(path).ok
    art = load_artifact(path)
    assert art.layer_group_sizes == [16, 4, 8] and art.group_size == 8
    sch = KVScheme.from_artifact(art)
    assert sch.k_groups == [16, 4, 8] and sch.v_groups == [16, 4, 8] and sch.group_size == 8
    assert sch.bits_per_element == pytest.approx((2 + 32 / 16 + 2 + 32 / 4 + 2 + 32 / 8) / 3)
    forced = KVScheme.from_artifact(art, group_size=16)          # an explicit size still wins, everywhere
    assert forced.k_groups == [16] * 3 and forced.uniform_groups


def test_old_artifacts_read_as_one_size(tmp_path):
    art = load_artifact(make_artifact(tmp_path / "old", layers=2, d=16))
    assert "layer_group_sizes" not in art.metadata
    assert art.layer_group_sizes == [16, 16]
    assert KVScheme.from_artifact(art).uniform_groups


def test_real_cache_and_simulations_store_each_layer_with_its_size():
    """Per-layer sizes (K = V within a layer): the real cache, the decode simulation and the
    perplexity simulation read the same values (float32 window), and differ from one uniform size."""
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
    split = KVScheme("s", 2, d, rot, rot, k_groups=[d, d], v_groups=[d, d // 2])
    for cache in (OscarCache, SimulatedCache):
        with pytest.raises(InputError, match=f"layer 1 stores K in groups of {d} and V in groups of {d // 2}"):
            cache(m.config, split)


def test_a_bad_layer_group_list_is_refused_by_every_reader(tmp_path):
    bad = make_artifact(tmp_path / "bad", layers=2, d=8, metadata={"layer_group_sizes": "8,3"})
    with pytest.raises(ArtifactError, match="3 is not a power of two dividing head_dim 8"):
        load_artifact(bad)
    with pytest.raises(ArtifactError, match="3 is not a power of two"):
        KVScheme.from_artifact(bad)
