"""scripts/experiments/ablation.py's table: a NIAH column attached from scripts/experiments/niah_gpu.py
results (--niah, --render), in this process."""

import json

import pytest
from factories import load_script, script_error

pytestmark = pytest.mark.script


def _module():
    return load_script("experiments/ablation.py")


def _results():
    settings = {"model": "m", "eval_sequences": 2, "eval_seq_len": 64, "sink": 4, "recent": 8, "calibration_seed": 0,
                "heldout_tokens": 32, "texts": ["embedded"]}
    rows = {"bf16": {"ppl": {"embedded": 8.0}, "bits_per_element": 16.0, "group_size": None},
            "default": {"ppl": {"embedded": 8.4}, "bits_per_element": 2.5, "group_size": 64}}
    return {"settings": settings, "rows": rows, "command": "python scripts/experiments/ablation.py m"}


def _niah(tmp_path, name="n.json", rates=(("bf16", 0.5), ("oscar", 0.25))):
    summ = [{"method": m, "by_length": {"1024": 0.1, "8192": r}, "by_length_interval": {"1024": [0, 0.2], "8192": [r - 0.1, r + 0.1]},
             "by_length_n": {"1024": 50, "8192": 50}} for m, r in rates]
    p = tmp_path / name
    p.write_text(json.dumps({"summary": summ, "settings": {"haystack_sha256": "abcd" * 4}}))
    return p


def test_niah_column_from_the_largest_length(tmp_path):
    mod = _module()
    res = _results()
    p = _niah(tmp_path)
    mod.attach_niah(res, [f"default={p}:oscar", f"bf16={p}:bf16"])
    assert res["rows"]["default"]["niah"]["length"] == 8192 and res["rows"]["default"]["niah"]["rate"] == 0.25
    text = mod.table(res)
    assert "NIAH, largest length [95%]" in text
    assert "| default | 64 | 2.500 | 8.400 (+5.00%, –) | 0.25 [0.15, 0.35] at 8192 (a) |" in text
    assert "filler sha256 abcdabcdabcdabcd" in text
    assert "NIAH" not in mod.table(_results())      # no column without NIAH


@pytest.mark.parametrize("spec, message", [
    ("default", "expected VARIANT=RESULT.json:METHOD"),
    ("nope={p}:oscar", "no row 'nope'"),
    ("default={p}:fork", "no NIAH rates for method 'fork'"),
    ("default={missing}:oscar", "cannot read"),
])
def test_niah_spec_errors(tmp_path, spec, message):
    mod = _module()
    p = _niah(tmp_path)
    with pytest.raises(SystemExit, match=message):
        mod.attach_niah(_results(), [spec.format(p=p, missing=tmp_path / "missing.json")])


def test_render_writes_the_table_without_a_model(tmp_path, capsys):
    out = tmp_path / "abl.json"
    out.write_text(json.dumps(_results()))
    p = _niah(tmp_path)
    _module().main(["--render", "--out", str(out), "--niah", f"default={p}:oscar"])
    md = out.with_suffix(".md").read_text()
    assert "0.25 [0.15, 0.35] at 8192 (a)" in md and "NIAH attached with: `python scripts/experiments/ablation.py --render" in md
    assert json.loads(out.read_text())["rows"]["default"]["niah"]["method"] == "oscar"
    assert "0.25 [0.15, 0.35] at 8192 (a)" in capsys.readouterr().out
    assert script_error(_module().main, ["--render", "--out", str(tmp_path / "none.json")]) == (
        "error: --render needs --out naming an existing ablation JSON")


def _tiny_split_scheme():
    import torch
    from factories import tiny_model

    from oscar_calib.kernels.testing import random_rotation
    from oscar_calib.model.geometry import geometry_of
    from oscar_calib.runtime.scheme import KVScheme

    m = tiny_model("llama", layers=2)
    geo = geometry_of(m)
    d, h = geo.head_dim, geo.num_kv_heads
    rot = [random_rotation(h, d, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    sch = KVScheme("s", 2, d, rot, rot, [torch.full((h,), 0.95)] * 2, [torch.full((h,), 0.9)] * 2, sink=4, recent=8,
                   window_dtype=None, k_groups=[d // 4, d], v_groups=[d, d // 2])
    return m, geo, sch


def test_real_cache_perplexity_equals_the_simulation_one_step_at_a_time():
    """``--real-cache 1``: teacher forcing through OscarCache one decode step per token reads what the
    perplexity simulation reads (K and V in groups of different sizes here)."""
    import torch

    mod = _module()
    m, _, sch = _tiny_split_scheme()
    ids = torch.randint(1, 120, (60,), generator=torch.Generator().manual_seed(0))
    sim = mod.perplexity(m, [ids], sch)
    real = mod.perplexity(m, [ids], sch, real_chunk=1)
    assert abs(real / sim - 1) < 1e-5 and mod.real_storable(sch)


def test_lever_simulation_equals_the_plain_one_with_every_lever_off():
    """levers.py: with fp16 parameters and no lever, LeverKV reads what SimulatedKV reads; a lever's
    bits count its parameters and sparse entries."""
    levers = load_script("experiments/levers.py")

    _, geo, sch = _tiny_split_scheme()
    assert levers.self_check(sch, geo.head_dim) < 1e-4
    d = geo.head_dim
    lev = levers.lever_scheme(sch, d, params="fp8", sparse=1)
    assert lev.layer_bits(0) == pytest.approx((2 + 16 / (d // 4) + 2 + 16 / d) / 2 + (8 + 4) / d)
    assert lev.bits_per_element < sch.bits_per_element
