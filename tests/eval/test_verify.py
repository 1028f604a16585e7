"""oscar verify: passes on a calibrated artifact, fails on a deliberately bad one, runs the
Triton kernels (interpreter on CPU), refuses an artifact of another model."""

import json
import os
import shutil

import pytest
import torch
from factories import FAST, loaded_tiny

from oscar_calib.calibration.pipeline import calibrate
from oscar_calib.contract.artifact import load_artifact, write_artifact_files
from oscar_calib.contract.config import CalibrationConfig
from oscar_calib.errors import ArtifactError
from oscar_calib.eval.verify import verify_artifact

QUICK = dict(depths=(400, 700), sequences=1, positions=2)


def bad_copy(src, dst):
    """Identity rotations and no clipping: what OSCAR exists to beat."""
    art = load_artifact(src)
    for layer in art.layers:
        eye = torch.eye(layer.k_rotation.shape[-1]).expand_as(layer.k_rotation).clone()
        layer.k_rotation, layer.v_rotation = eye, eye.clone()
        layer.k_clip = torch.ones_like(layer.k_clip)
        layer.v_clip = torch.ones_like(layer.v_clip)
    dst.mkdir()
    write_artifact_files(dst, art, "bad\n", {})
    return dst


@pytest.mark.slow
def test_verify_passes_on_demo_and_fails_on_identity(tmp_path, demo_artifact, smollm2_loaded):
    good = tmp_path / "good"
    shutil.copytree(demo_artifact, good)
    res = verify_artifact(good, loaded=smollm2_loaded, backend="torch", **QUICK)
    s = res.summary()
    assert res.passed, res.reasons
    assert s["mean_attn_error"] < s["mean_attn_error_hadamard"]
    doc = json.loads((good / "verify.json").read_text())
    assert doc["passed"] is True and len(doc["layers"]) == 30
    assert (good / "verify.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    bad = bad_copy(demo_artifact, tmp_path / "bad")
    res_bad = verify_artifact(bad, loaded=smollm2_loaded, backend="torch", **QUICK)
    assert not res_bad.passed
    assert res_bad.summary()["mean_attn_error"] > s["mean_attn_error"]
    assert json.loads((bad / "verify.json").read_text())["passed"] is False


@pytest.mark.slow
def test_a_refined_smollm2_artifact_validates_and_verifies(tmp_path, smollm2_loaded):
    from oscar_calib.tools.validate import validate_artifact

    out = tmp_path / "refined"
    res = calibrate(CalibrationConfig(**{**FAST, "refine_steps": 4, "refine_lr": 1e-2, "heldout_seqs": 2}), out,
                    loaded=smollm2_loaded)
    assert any(h["best_step"] > 0 for row in res.report["layers"] for h in row["refine"])
    assert validate_artifact(out).ok
    v = verify_artifact(out, loaded=smollm2_loaded, backend="torch", write=False, **QUICK)
    assert v.passed, v.reasons
    assert v.summary()["mean_attn_error"] < v.summary()["mean_attn_error_hadamard"]


def _kernel_sized_artifact(tmp_path):
    """A tiny Llama (head_dim 64, 2 layers, on the CPU) and its artifact with a short sink and
    window, so that verify's depths leave an INT2 history for the kernels."""
    lm = loaded_tiny("llama", head_dim=64, layers=2)
    out = tmp_path / "a"
    calibrate(CalibrationConfig(**{**FAST, "tokens": 512, "seq_len": 128, "heldout_tokens": 64, "sink_tokens": 4,
                                   "recent_tokens": 16}), out, loaded=lm)
    return lm, out


def test_verify_runs_the_triton_kernels_and_matches_torch(tmp_path):
    """Triton against torch: under the interpreter on the CPU; on a GPU machine with the model on the
    GPU (the real compiler; a CPU model there would switch the whole process to the interpreter)."""
    assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
    lm, out = _kernel_sized_artifact(tmp_path)
    if torch.cuda.is_available():
        lm.model.to("cuda")
    kw = dict(loaded=lm, depths=(56, 72), sequences=1, positions=1, write=False)    # INT2 histories of 36 and 52
    t = verify_artifact(out, backend="triton", **kw)
    r = verify_artifact(out, backend="torch", **kw)
    assert t.settings["backend"] == "triton"
    for a, b in zip(t.layers, r.layers):
        assert a["artifact"]["attn"] == pytest.approx(b["artifact"]["attn"], rel=2e-2, abs=1e-3)
        assert a["hadamard"]["logit"] == pytest.approx(b["hadamard"]["logit"], rel=2e-2, abs=1e-3)
        assert a["artifact"]["attn"] > 0          # the INT2 history really was quantised


@pytest.mark.gpu
def test_verify_on_cuda_gives_the_cpu_figures(tmp_path):
    """The same artifact verified with the model on a GPU: every layer's figures, the fork's
    simulation (one call over the longest prefix, rows at their own positions) included, are the
    CPU run's up to float32 summation order; the Triton kernels' too."""
    lm, out = _kernel_sized_artifact(tmp_path)
    kw = dict(depths=(56, 72, 100), sequences=1, positions=3, write=False)
    cpu = verify_artifact(out, loaded=lm, backend="torch", **kw)
    lm.model.to("cuda")
    for backend in ("torch", "triton"):
        gpu = verify_artifact(out, loaded=lm, backend=backend, **kw)
        assert gpu.settings["device"].startswith("cuda") and gpu.settings["backend"] == backend
        for a, b in zip(gpu.layers, cpu.layers):
            assert b["fork"]["attn"] > 0
            for method in ("artifact", "hadamard", "fork"):       # (an INT2 code may flip at a rounding tie)
                assert a[method]["attn"] == pytest.approx(b[method]["attn"], rel=2e-2, abs=1e-3), (backend, method)


def test_verify_refuses_an_artifact_of_another_model(tiny_calibrated):
    tiny_artifact = tiny_calibrated
    with pytest.raises(ArtifactError, match="another model"):
        verify_artifact(tiny_artifact, loaded=loaded_tiny("qwen3"), backend="torch", write=False, **QUICK)
    assert not (tiny_artifact / "verify.json").exists()
    lm = loaded_tiny("llama")
    with pytest.raises(TypeError, match="LoadedModel"):
        verify_artifact(tiny_artifact, loaded=(lm.model, lm.tokenizer), write=False, **QUICK)


@pytest.mark.parametrize("kind", ["nan", "skewed"])
def test_verify_refuses_an_invalid_artifact_up_front(tiny_calibrated, tmp_path, kind):
    """A NaN or a non-orthogonal rotation is refused with the validator's line before
    any model is loaded (here there is no such model), never "error nan is not below the baseline"."""
    art = load_artifact(tiny_calibrated)
    if kind == "nan":
        art.layers[1].k_rotation[0, 2, 3] = float("nan")
        line = "layers.1.k_rotation has 1 non-finite value(s)"
    else:
        art.layers[0].v_rotation[1] *= 1.01
        line = "layers.0.v_rotation is not orthogonal"
    bad = tmp_path / kind
    bad.mkdir()
    write_artifact_files(bad, art, "bad\n", {})
    with pytest.raises(ArtifactError) as exc:
        verify_artifact(bad, model="no-such-org/no-such-model", backend="torch", **QUICK)
    assert str(exc.value).startswith(f"{bad}: {line}")
    assert not (bad / "verify.json").exists()


def test_verify_reports_the_fork_scheme(tmp_path):
    """The fork's attention error per layer (pure-torch simulation): one call per query position with
    the cache [0, p] equals that position's row of a whole-sequence simulation; shown by the CLI."""
    from oscar_calib.cli.verify import render
    from oscar_calib.eval.verify import _fork_layer_errors
    from oscar_calib.runtime.scheme import KVScheme
    from oscar_calib.runtime.simulate import SimulatedKV

    lm = loaded_tiny("llama")
    out = tmp_path / "a"
    calibrate(CalibrationConfig(**{**FAST, "tokens": 256, "seq_len": 64, "heldout_tokens": 32, "sink_tokens": 4,
                                   "recent_tokens": 8}), out, loaded=lm)
    res = verify_artifact(out, loaded=lm, backend="torch", depths=(40, 56), sequences=1, positions=2)
    s = res.summary()
    assert all(r["fork"]["attn"] > 0 for r in res.layers)
    assert s["mean_attn_error_fork"] == pytest.approx(sum(r["fork"]["attn"] for r in res.layers) / len(res.layers))
    art = load_artifact(out)
    assert res.settings["fork"]["k_clip"] == art.shared_clips()[0] and res.settings["fork"]["sink_tokens"] == 4
    assert json.loads((out / "verify.json").read_text())["summary"]["mean_attn_error_fork"] == s["mean_attn_error_fork"]

    g = torch.Generator().manual_seed(0)
    caps = {"q": torch.randn(1, 30, 4, 16, generator=g), "k": 3 * torch.randn(1, 30, 2, 16, generator=g),
            "v": torch.randn(1, 30, 2, 16, generator=g), "at": {p: p for p in range(30)}}
    fork = KVScheme.shared_from_artifact(art, quantizer="fork")
    full = SimulatedKV(None, fork).attend(0, caps["q"].transpose(1, 2), caps["k"].transpose(1, 2),
                                          caps["v"].transpose(1, 2), None, 0.25, None, None)      # [1, 30, 4, 16]
    caps["o"] = full.clone()
    assert _fork_layer_errors(caps, [(0, 30), (0, 22), (0, 15)], fork, 0, 0.25, None)["attn"] < 1e-6
    caps["o"][0, 21] *= 1.1                                 # a 10% error at one sampled position shows
    err = _fork_layer_errors(caps, [(0, 22)], fork, 0, 0.25, None)["attn"]
    assert err == pytest.approx(0.1 / 1.1, rel=1e-4)

    import io

    from rich.console import Console

    import oscar_calib.cli.verify as cv
    buf = io.StringIO()
    old = cv.stdout
    cv.stdout = Console(file=buf, width=200)
    try:
        render(res, json_out=False)
    finally:
        cv.stdout = old
    text = buf.getvalue()
    assert "fork attn" in text and f"mean attention error {s['mean_attn_error_fork']:.4f} (informational)" in text


def test_verify_runs_each_layer_of_a_bit_budget_artifact_at_its_size(tmp_path):
    """Per-layer sizes: each layer goes through the write/decode path with its own group size (a
    layer verified at another size gives another error), and the settings name the sizes."""
    lm = loaded_tiny("llama", head_dim=64, layers=3)
    out = tmp_path / "b"
    calibrate(CalibrationConfig(**{**FAST, "tokens": 512, "seq_len": 64, "heldout_tokens": 48, "sink_tokens": 4,
                                   "recent_tokens": 8, "bit_budget": 2.7}), out, loaded=lm)
    art = load_artifact(out)
    sizes = art.settings.k_groups
    assert sorted(sizes) == [32, 64, 64]
    kw = dict(loaded=lm, backend="torch", depths=(40, 56), sequences=1, positions=2, write=False)
    res = verify_artifact(out, **kw)
    assert res.settings["layer_group_sizes"] == sizes
    uniform = tmp_path / "u"
    shutil.copytree(out, uniform)
    md = dict(art.metadata)
    del md["layer_group_sizes"]
    write_artifact_files(uniform, type(art)(layers=art.layers, metadata=md), "u\n", art.report)
    flat = verify_artifact(uniform, **kw)
    small = sizes.index(32)
    for i in range(3):
        same = res.layers[i]["artifact"]["attn"] == flat.layers[i]["artifact"]["attn"]
        assert same == (i != small)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_verify_reads_centered_keys_as_the_cache_stores_them(backend):
    """Key centering in verify's write/decode path: keys ``k + μ`` verified with ``k_mean = μ`` give
    the attention error of keys ``k`` verified without centering (window and history hold the same
    stored keys, the query's logits all move by ``q·μ``), and the logits are compared in the model's
    basis (the same numerator); a centering missing from the window or the history would not."""
    from oscar_calib.eval.verify import _layer_errors, _samples
    from oscar_calib.kernels.testing import random_rotation

    if backend == "triton":
        assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(12)
    h, hq, d, t = 2, 4, 64, 60
    samples = _samples((48, 60), 2, 7, None)
    at = {p: j for j, p in enumerate(sorted({e - 1 for _, e in samples}))}
    k = torch.randn(1, t, h, d, generator=g)
    mu = torch.randn(h, d, generator=g) * 4
    caps = {"k": k, "v": torch.randn(1, t, h, d, generator=g), "q": torch.randn(1, len(at), hq, d, generator=g),
            "o": torch.randn(1, len(at), hq, d, generator=g), "at": at}
    rot = random_rotation(h, d, generator=g)
    kw = dict(group_size=32, v_group_size=32, sink=4, recent=8, backend=backend, scaling=d ** -0.5)
    clips = (torch.tensor([0.95, 0.9]), torch.tensor([0.92, 0.92]))
    moved = {n: (x.to(dev) if torch.is_tensor(x) else x) for n, x in dict(caps, k=k + mu).items()}
    plain = {n: (x.to(dev) if torch.is_tensor(x) else x) for n, x in caps.items()}
    args = (rot.to(dev), clips[0].to(dev), rot.to(dev), clips[1].to(dev))
    centered = _layer_errors(moved, samples, *args, **kw, k_mean=mu.to(dev))
    uncentered = _layer_errors(plain, samples, *args, **kw)
    assert centered["attn"] == pytest.approx(uncentered["attn"], rel=1e-3)
    ignored = _layer_errors(moved, samples, *args, **kw)                    # the shifted keys served raw
    assert abs(ignored["attn"] - uncentered["attn"]) > 1e-2 * uncentered["attn"]
