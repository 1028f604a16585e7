"""The logit-noise correction: its formula, the perplexity simulation against the lever
simulation it came from, and the real cache (torch path) against the simulation, decode step by
decode step."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from factories import load_script, sharpen, tiny_model

from oscar_calib.errors import InputError
from oscar_calib.model.geometry import geometry_of
from oscar_calib.numerics.quant import logit_noise
from oscar_calib.runtime import KVScheme, OscarCache, SimulatedCache
from oscar_calib.runtime.simulate import SimulatedKV


def corrected(model, gain, *, group_size=8, window_dtype=None, sink=2, recent=3):
    geo = geometry_of(model)
    base = KVScheme.uniform("hadamard", geo.num_layers, geo.num_kv_heads, geo.head_dim, group_size,
                            rotation="hadamard", clips=(0.96, 0.92), sink=sink, recent=recent,
                            window_dtype=window_dtype)
    return dataclasses.replace(base, logit_correction=gain)


def sharp(kind):
    """A tiny random model of ``kind``, sharpened."""
    return sharpen(tiny_model(kind, layers=2))


def test_the_formula_on_one_pair():
    g = torch.Generator().manual_seed(0)
    q, s = torch.randn(1, 8, generator=g), torch.rand(1, 2, generator=g) + 0.1
    want = 0.7 / 2 * 0.25 ** 2 * sum(float(q[0, 4 * j:4 * j + 4].pow(2).sum()) * float(s[0, j]) ** 2 / 12
                                      for j in range(2))
    assert logit_noise(q, s, 4, 0.7, 0.25).item() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("gain", [0.5, 1.0])
def test_perplexity_simulation_equals_the_lever_simulation(gain):
    """SimulatedKV with the correction against scripts/experiments/levers.py's LeverKV (its own
    fake quantiser and formula) on a tiny GQA model."""
    levers = load_script("experiments/levers.py")
    m = sharp("llama")
    ids = torch.randint(1, 120, (1, 24), generator=torch.Generator().manual_seed(5))
    sch = corrected(m, gain)
    with SimulatedKV(m, sch):
        ours = m(ids).logits
    base = corrected(m, 0.0)
    lever = levers.lever_scheme(base, geometry_of(m).head_dim, logit_correction=gain)
    with levers.LeverKV(m, lever):
        theirs = m(ids).logits
    with SimulatedKV(m, base):
        plain = m(ids).logits
    assert (ours - theirs).abs().max() < 1e-4
    assert (ours - plain).abs().max() > 1e-3                   # the correction changed something


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_real_cache_decode_equals_the_simulation(kind):
    """One token per call through OscarCache (the torch path on the CPU), float32 window: every
    step reads what SimulatedKV reads for that position, correction included."""
    m = sharp(kind)
    ids = torch.randint(1, 120, (1, 26), generator=torch.Generator().manual_seed(7))
    sch = corrected(m, 1.0)
    with SimulatedKV(m, sch):
        sim = m(ids).logits
    cache = OscarCache(m.config, sch, backend="torch")
    with cache.attach(m), torch.no_grad():
        real = torch.cat([m(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(26)], 1)
    with SimulatedKV(m, corrected(m, 0.0)):
        uncorrected = m(ids).logits
    assert cache.layers[-1].store.history_span() > 0
    assert (real - sim).abs().max() < 1e-4
    assert (sim - uncorrected).abs().max() > 1e-3


def test_bad_gains_and_schemes_are_refused():
    m = tiny_model("llama", layers=2)
    for bad in (-0.1, 5, math.nan, "x"):
        with pytest.raises(InputError, match="logit_correction must be a number in"):
            corrected(m, bad)
    with pytest.raises(InputError, match="oscar's INT2 history only"):
        dataclasses.replace(KVScheme.full_precision(geometry_of(m).num_layers), logit_correction=1.0)
    with pytest.raises(InputError, match="SimulatedCache .* cannot subtract"):
        SimulatedCache(m.config, corrected(m, 1.0))


def test_calibrate_stores_the_gain_the_schemes_read_it_and_exports_say_what_they_drop(tmp_path):
    from factories import calibrate_tiny

    from oscar_calib.contract.artifact import load_artifact
    from oscar_calib.tools.export import export_artifact
    from oscar_calib.tools.validate import validate_artifact

    res = calibrate_tiny(tmp_path / "art", logit_correction=0.5)
    art = load_artifact(tmp_path / "art")
    assert art.metadata["logit_correction"] == "0.5" and art.logit_correction == 0.5
    assert KVScheme.from_artifact(art).logit_correction == 0.5
    assert KVScheme.from_artifact(art, logit_correction=0.0).logit_correction == 0.0
    assert validate_artifact(tmp_path / "art").ok
    plain = calibrate_tiny(tmp_path / "plain")
    assert "logit_correction" not in load_artifact(tmp_path / "plain").metadata     # additive: absent when off
    out = export_artifact(tmp_path / "art", tmp_path / "onnx", "onnxruntime")
    assert any("logit-noise correction" in w and "0.5" in w for w in out.warnings)
    assert not any("logit-noise" in w for w in export_artifact(tmp_path / "plain", tmp_path / "onnx2",
                                                                "onnxruntime").warnings)
    assert res.artifact is not None and plain.artifact is not None


@pytest.mark.parametrize("value,ok", [("0.5", True), ("0", True), ("-1", False), ("nan", False), ("lots", False),
                                      ("4.5", False)])
def test_validate_checks_the_stored_gain(value, ok):
    from oscar_calib.contract.values import check_metadata_values

    problems = [p for p in check_metadata_values({"model_id": "m", "logit_correction": value})[0]
                if "logit_correction" in p]
    assert (not problems) == ok, problems


def test_eval_takes_a_gain_for_oscar_and_records_only_what_the_artifact_stores(tmp_path):
    from factories import calibrate_tiny, loaded_tiny, oscar

    from oscar_calib.contract.artifact import load_artifact
    from oscar_calib.eval import EvalOptions, evaluate_ppl

    lm = loaded_tiny("llama", layers=2)
    sharpen(lm.model)
    calibrate_tiny(tmp_path / "art", loaded=lm, logit_correction=1.0)
    art = load_artifact(tmp_path / "art")
    opts = EvalOptions(methods="oscar", sequences=1, seq_len=200, sink=4, recent=8)
    stored = evaluate_ppl(lm, opts, artifact=art).rows[0]
    off = evaluate_ppl(lm, opts.replace(logit_correction=0.0), artifact=art).rows[0]
    assert stored["logit_correction"] == 1.0 and "logit_correction" not in off
    assert stored["ppl"] != off["ppl"]
    with pytest.raises(InputError, match="--logit-correction must be a number"):
        EvalOptions(logit_correction=-2)
    code, _, err = oscar("eval", "smollm2-135m", str(tmp_path / "art"), "--logit-correction", "0.5", "--record")
    assert code != 0 and "leave out --logit-correction" in err
