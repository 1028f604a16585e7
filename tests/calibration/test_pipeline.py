"""calibrate() end to end on tiny models and the real SmolLM2: artifact contract, determinism,
resume, architectures and error paths."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from factories import FAST, TESTS, TINY_FAST, calibrate_tiny, loaded_tiny, sha256
from safetensors import safe_open

from oscar_calib.calibration.checkpoint import CHECKPOINT_NAME
from oscar_calib.calibration.pipeline import calibrate
from oscar_calib.contract.artifact import load_artifact
from oscar_calib.contract.config import CalibrationConfig
from oscar_calib.contract.layout import (
    REQUIRED_METADATA,
    SHARED_KINDS,
    TENSOR_KINDS,
    tensor_name,
)
from oscar_calib.errors import (
    DataError,
    InputError,
    Interrupted,
    NumericalError,
    OscarWarning,
    OutputExistsError,
)


def check_contract(out: Path, layers: int, heads: int, kv: int, d: int):
    with safe_open(str(out / "oscar.safetensors"), "pt") as f:
        md = f.metadata()
        keys = set(f.keys())
        tensors = {k: f.get_tensor(k) for k in keys}
    assert set(REQUIRED_METADATA) <= set(md)
    assert md["format"] == "oscar-rotations" and md["format_version"] == "1" and md["bits"] == "2"
    assert (md["num_layers"], md["num_attention_heads"], md["num_kv_heads"], md["head_dim"]) == tuple(
        map(str, (layers, heads, kv, d)))
    cal = json.loads(md["calibration"])
    assert {"data", "tokens", "seq_len", "seed", "token_sha256"} <= set(cal)
    shared = SHARED_KINDS if md["granularity"] == "head" and kv > 1 else ()   # one rotation per layer, for engines
    assert keys == {tensor_name(i, k) for i in range(layers) for k in TENSOR_KINDS + shared}
    assert all(0 < float(md[k]) <= 1 for k in ("fork_k_clip", "fork_v_clip"))
    for i in range(layers):
        r = tensors[tensor_name(i, "k_rotation")]
        assert r.shape == (kv, d, d) and r.dtype == torch.float32
        assert float((r @ r.transpose(1, 2) - torch.eye(d)).abs().max()) < 1e-5
        assert tensors[tensor_name(i, "v_rotation")].shape == (kv, d, d)
        for c in ("k_clip", "v_clip"):
            t = tensors[tensor_name(i, c)]
            assert t.shape == (kv,) and bool(((t > 0) & (t <= 1)).all())
        for e in ("k_eigenvalues", "v_eigenvalues"):
            t = tensors[tensor_name(i, e)]
            assert t.shape == (kv, d) and bool((t[:, :-1] >= t[:, 1:] - 1e-6).all())
    assert (out / "README.md").read_text().startswith("---")
    report = json.loads((out / "calibration.json").read_text())
    assert len(report["layers"]) == layers and "summary" in report
    assert not (out / CHECKPOINT_NAME).exists()
    return md, tensors


@pytest.mark.parametrize("kind,heads,kv", [("llama", 4, 2), ("llama_mha", 4, 4), ("qwen3", 4, 2),
                                           ("qwen2", 4, 2), ("mistral", 4, 2), ("gemma3", 4, 1)])
def test_architectures_end_to_end(tmp_path, kind, heads, kv):
    calibrate_tiny(tmp_path / "a", kind)
    check_contract(tmp_path / "a", 2, heads, kv, 16)


def test_layer_granularity_and_fixed_clips(tmp_path):
    _, t = check_contract(calibrate_tiny(tmp_path / "a", granularity="layer", k_clip=0.96, v_clip=0.92).out, 2, 4, 2, 16)
    r = t["layers.0.k_rotation"]
    assert torch.equal(r[0], r[1])
    assert torch.allclose(t["layers.1.k_clip"], torch.tensor([0.96, 0.96]))
    assert torch.allclose(t["layers.1.v_clip"], torch.tensor([0.92, 0.92]))


def test_refined_rotations_stay_v1_and_are_recorded(tmp_path):
    # the tiny run holds 48 held-out rows: a sink of 8 leaves 40 quantised
    base = calibrate_tiny(tmp_path / "a", "qwen3", sink_tokens=8, recent_tokens=16, heldout_seqs=2)
    with pytest.warns(OscarWarning, match="one held-out sequence"):
        calibrate_tiny(tmp_path / "c", "qwen3", sink_tokens=8, recent_tokens=16, refine_steps=1)
    res = calibrate_tiny(tmp_path / "b", "qwen3", sink_tokens=8, recent_tokens=16, refine_steps=6, refine_lr=1e-2,
                   heldout_seqs=2)
    md, t = check_contract(res.out, 2, 4, 2, 16)                  # still orthogonal [h, d, d], v1
    assert json.loads(md["calibration"])["refine"] == {"steps": 6, "lr": 1e-2, "objective": "attention-output",
                                                      "sink": 8, "fit_sequences": 1, "validation_sequences": 1}
    assert "refine" not in json.loads(load_artifact(base.out).metadata["calibration"])
    a0, a1 = load_artifact(base.out), load_artifact(res.out)
    moved = 0
    for i, (row, row0) in enumerate(zip(res.report["layers"], base.report["layers"])):
        assert "refine" not in row0 and len(row["refine"]) == 2
        for h, r in enumerate(row["refine"]):
            assert r["after"] <= r["before"]
            same = torch.equal(a1.layers[i].k_rotation[h], a0.layers[i].k_rotation[h])
            assert same == (r["best_step"] == 0)                 # a head moves exactly when a step won
            moved += not same
    assert moved > 0


def test_refine_settings_are_checked():
    for kw in ({"refine_steps": -1}, {"refine_lr": 0.0}, {"refine_steps": 2, "granularity": "layer"}):
        with pytest.raises(InputError):
            CalibrationConfig(**{**TINY_FAST, **kw}).validate()


def test_rerun_is_byte_identical(tmp_path, tiny_calibrated):
    a = tiny_calibrated
    b = calibrate_tiny(tmp_path / "b").out
    assert sha256(a / "oscar.safetensors") == sha256(b / "oscar.safetensors")
    c = calibrate_tiny(tmp_path / "c", seed=1).out
    assert sha256(a / "oscar.safetensors") != sha256(c / "oscar.safetensors")


def test_resume_after_ctrl_c_is_byte_identical(tmp_path, tiny_calibrated):
    ref = tiny_calibrated
    out = tmp_path / "run"

    def interrupt(batches_done):
        if batches_done == 3:
            raise KeyboardInterrupt

    lm = loaded_tiny()
    cfg = CalibrationConfig(**TINY_FAST)
    with pytest.raises(Interrupted, match=r"after batch 3 of 4; the checkpoint at batch 3 is kept .*--resume"):
        calibrate(cfg, out, loaded=lm, on_batch=interrupt)
    assert (out / CHECKPOINT_NAME).exists() and not (out / "oscar.safetensors").exists()
    with pytest.raises(OutputExistsError, match="checkpoint of an interrupted run .*--resume .*--overwrite"):
        calibrate(cfg, out, loaded=lm)                    # never silently discards the checkpoint
    seen = []
    res = calibrate(cfg, out, loaded=lm, resume=True,
                    progress=lambda stage, done, total, unit: stage == "capture" and seen.append(done))
    assert res.report["timings"]["resumed"] is True
    assert seen[0] > 0                                    # started from the checkpoint, not from zero
    assert sha256(out / "oscar.safetensors") == sha256(ref / "oscar.safetensors")


@pytest.mark.slow
def test_resume_after_kill_9_is_byte_identical(tmp_path, tiny_calibrated):
    ref = tiny_calibrated
    out = tmp_path / "run"
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(TESTS)!r})
        from factories import TINY_FAST, loaded_tiny
        from oscar_calib.contract.config import CalibrationConfig
        from oscar_calib.calibration.pipeline import calibrate

        def die(n):
            if n == 3:
                os.kill(os.getpid(), signal.SIGKILL)
        calibrate(CalibrationConfig(**TINY_FAST), {str(out)!r}, loaded=loaded_tiny(), on_batch=die)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert (out / CHECKPOINT_NAME).exists() and not (out / "oscar.safetensors").exists()
    res = calibrate(CalibrationConfig(**TINY_FAST), out, loaded=loaded_tiny(), resume=True)
    assert res.report["timings"]["resumed"] is True
    assert sha256(out / "oscar.safetensors") == sha256(ref / "oscar.safetensors")


def test_key_centering_end_to_end(tmp_path, tiny_calibrated):
    """``center_keys``: every layer stores its mean key (the streamed statistics'), the key objective
    and clips are fitted on centered keys, and what the engines without centering serve (shared
    rotations, global clips, the Hadamard baseline) is the uncentered run's; an interrupted run
    resumes byte-identically (the key sum is in the checkpoint)."""
    cfg = CalibrationConfig(**{**TINY_FAST, "center_keys": True})
    lm = loaded_tiny()

    def interrupt(batches_done):
        if batches_done == 2:
            raise KeyboardInterrupt

    with pytest.raises(Interrupted):
        calibrate(cfg, tmp_path / "c", loaded=lm, on_batch=interrupt)
    res = calibrate(cfg, tmp_path / "c", loaded=lm, resume=True)
    assert res.report["timings"]["resumed"] is True
    calibrate(cfg, tmp_path / "w", loaded=lm)
    assert sha256(tmp_path / "c" / "oscar.safetensors") == sha256(tmp_path / "w" / "oscar.safetensors")
    art, plain = load_artifact(tmp_path / "c"), load_artifact(tiny_calibrated)
    assert art.metadata["k_centered"] == "true" and "k_centered" not in plain.metadata
    assert "| key centering |" in (tmp_path / "c" / "README.md").read_text()
    assert "fitted on the centered keys" in (tmp_path / "c" / "README.md").read_text()
    assert art.settings.key_center_fit == "centered"
    assert "| key centering |" not in (tiny_calibrated / "README.md").read_text()
    ref = json.loads((tiny_calibrated / "calibration.json").read_text())["layers"]
    for i, (lr, lp) in enumerate(zip(art.layers, plain.layers)):
        assert torch.equal(lr.k_mean, res.stats.stats[i].key_mean().float()) and lp.k_mean is None
        assert lr.k_mean.abs().max() > 0
        assert not torch.allclose(lr.k_rotation, lp.k_rotation)           # ktk of the centered keys
        assert torch.equal(lr.v_rotation, lp.v_rotation) and torch.equal(lr.v_clip, lp.v_clip)
        assert torch.equal(lr.k_layer_rotation, lp.k_layer_rotation)      # engines without centering: raw
        row = res.report["layers"][i]
        assert row["heldout"]["fork"] == ref[i]["heldout"]["fork"] and row["heldout"]["hadamard"] == ref[i]["heldout"]["hadamard"]
        assert row["k_mean_share"] == ref[i]["k_mean_share"] and all(0 < x < 1 for x in row["k_mean_share"])
    assert (art.metadata["fork_k_clip"], art.metadata["fork_v_clip"]) == (plain.metadata["fork_k_clip"],
                                                                          plain.metadata["fork_v_clip"])
    # one KV head: the per-head rotation fits centered keys, so the layer's uncentered one is stored beside it
    one, one_plain = (load_artifact(calibrate_tiny(tmp_path / n, "gemma3", **kw).out)
                      for n, kw in (("g", {"center_keys": True}), ("gp", {})))
    assert one_plain.layers[0].k_layer_rotation is None
    for lr, lp in zip(one.layers, one_plain.layers):
        assert torch.equal(lr.k_layer_rotation, lp.k_rotation[0]) and not torch.equal(lr.k_rotation, lp.k_rotation)
    assert one.metadata["fork_k_clip"] == one_plain.metadata["fork_k_clip"]


def test_key_centering_fitted_on_raw_keys_adds_the_mean_alone(tmp_path, tiny_bit_budget):
    """``center_fit: raw``: rotations, clips, the bit budget's group sizes and the engines' shared
    clips are those of the same recipe without centering, bit for bit; every layer adds the streamed
    statistics' mean key; the artifact and its card say so; the report's held-out errors are those of
    the keys as stored (centered), Hadamard's the uncentered baseline's."""
    from oscar_calib.contract.features import feature_lines

    plain = tiny_bit_budget
    lm = loaded_tiny("llama", head_dim=64, layers=3)
    res = calibrate_tiny(tmp_path / "r", loaded=lm, bit_budget=2.7, center_keys=True, center_fit="raw")
    art, ref = res.artifact, load_artifact(plain.out)
    assert art.settings.key_centering and art.settings.key_center_fit == "raw"
    assert art.metadata["k_centered"] == "true" and art.metadata["k_center_fit"] == "raw"
    assert art.settings.layer_groups == ref.settings.layer_groups and len(set(art.settings.k_groups)) == 2
    assert art.settings.group_size == ref.settings.group_size and art.settings.shared_clips == ref.settings.shared_clips
    for i, (lr, lp) in enumerate(zip(art.layers, ref.layers)):
        for kind in ("k_rotation", "v_rotation", "k_clip", "v_clip", "k_eigenvalues", "v_eigenvalues",
                     "k_layer_rotation", "v_layer_rotation"):
            assert torch.equal(getattr(lr, kind), getattr(lp, kind)), (i, kind)
        assert torch.equal(lr.k_mean, res.stats.stats[i].key_mean().float()) and lr.k_mean.abs().max() > 0
        row, prow = res.report["layers"][i], plain.report["layers"][i]
        assert row["heldout"]["hadamard"] == prow["heldout"]["hadamard"]
        assert row["heldout"]["oscar"] != prow["heldout"]["oscar"]          # the centered keys' error
    assert "fitted on the raw keys" in (tmp_path / "r" / "README.md").read_text()
    warnings, _ = feature_lines(art.settings, {"windows", "per_head_rotations", "layer_group_sizes"}, "engine W")
    assert any("(center_fit raw)" in w for w in warnings)


def test_key_mean_over_longer_windows(tmp_path, tiny_calibrated):
    """``center_seq_len``: the mean key comes from a pass of its own over the token budget cut into
    windows of that length (the statistics' mean of a calibration at that ``seq_len``), everything
    fitted stays the recipe's (``center_fit: raw``); the artifact's calibration record and card name
    the windows."""
    lm = loaded_tiny()
    res = calibrate_tiny(tmp_path / "m", loaded=lm, center_keys=True, center_fit="raw", center_seq_len=128)
    long = calibrate_tiny(tmp_path / "l", loaded=lm, center_keys=True, center_fit="raw", seq_len=128)
    short = calibrate_tiny(tmp_path / "s", loaded=lm, center_keys=True, center_fit="raw")
    plain = load_artifact(tiny_calibrated)
    for i, (lr, lp) in enumerate(zip(res.artifact.layers, plain.layers)):
        assert torch.equal(lr.k_mean, long.stats.stats[i].key_mean().float())
        assert not torch.allclose(lr.k_mean, short.artifact.layers[i].k_mean)
        assert torch.equal(lr.k_rotation, lp.k_rotation) and torch.equal(lr.k_clip, lp.k_clip)
    assert json.loads(res.artifact.metadata["calibration"])["center_seq_len"] == 128
    assert "center_seq_len" not in json.loads(short.artifact.metadata["calibration"])
    assert "over 128-token windows" in (tmp_path / "m" / "README.md").read_text()
    for bad, why in (({"center_seq_len": 128, "center_keys": True}, "needs --center-fit raw"),
                     ({"center_seq_len": 8, "center_keys": True, "center_fit": "raw"}, "at least 16")):
        with pytest.raises(InputError, match=why):
            CalibrationConfig(**{**TINY_FAST, **bad}).validate()


def test_resume_refuses_checkpoint_of_other_settings(tmp_path):
    out = tmp_path / "run"
    lm = loaded_tiny()

    def interrupt(n):
        if n == 2:
            raise KeyboardInterrupt

    with pytest.raises(Interrupted):
        calibrate(CalibrationConfig(**TINY_FAST), out, loaded=lm, on_batch=interrupt)
    with pytest.raises(InputError, match="other settings"):
        calibrate(CalibrationConfig(**{**TINY_FAST, "seed": 7}), out, loaded=lm, resume=True)


def test_existing_artifact_is_refused_unless_overwrite(tmp_path, tiny_calibrated):
    out = shutil.copytree(tiny_calibrated, tmp_path / "a")
    before = sha256(out / "oscar.safetensors")
    with pytest.raises(OutputExistsError, match="--overwrite"):
        calibrate_tiny(out, seed=3)
    assert sha256(out / "oscar.safetensors") == before
    cfg = CalibrationConfig(**{**TINY_FAST, "seed": 3})
    calibrate(cfg, out, loaded=loaded_tiny(), overwrite=True)
    assert sha256(out / "oscar.safetensors") != before


def test_nan_activations_are_named_and_leave_nothing(tmp_path):
    lm = loaded_tiny()
    lm.model.model.layers[1].self_attn.k_proj.weight[0, 0] = float("nan")
    out = tmp_path / "nan"
    with pytest.raises(NumericalError, match="layer 1: non-finite key"):
        calibrate_tiny(out, loaded=lm)
    assert not out.exists()


def test_data_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="no text"):
        calibrate_tiny(tmp_path / "o1", data=str(empty))
    short = tmp_path / "short.txt"
    short.write_text("only a few words here")
    with pytest.raises(DataError, match="need"):
        calibrate_tiny(tmp_path / "o2", data=str(short))
    with pytest.raises(DataError, match="no such file: .*missing.jsonl"):
        calibrate_tiny(tmp_path / "o3", data=str(tmp_path / "missing.jsonl"))
    with pytest.raises(InputError, match="tokens must be positive"):
        calibrate_tiny(tmp_path / "o4", tokens=0)
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 5))


def test_jsonl_and_directory_data(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    text = " ".join(f"word{i}" for i in range(3000))
    (docs / "a.jsonl").write_text("\n".join(json.dumps({"body": text[i:i + 500]}) for i in range(0, len(text), 500)))
    (docs / "b.txt").write_text(text)
    res = calibrate_tiny(tmp_path / "o", data=str(docs), text_field="body")
    assert res.report["calibration"]["data"] == "dir:docs"


@pytest.mark.slow
def test_single_process_never_enters_the_data_parallel_code(tmp_path):
    """A plain run calls the pipeline's hooks on ``Ranks()``: it neither imports
    calibration.parallel nor starts a process group."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from factories import TINY_FAST, loaded_tiny
        from oscar_calib.contract.config import CalibrationConfig
        from oscar_calib.calibration.pipeline import calibrate
        import torch.distributed as dist

        res = calibrate(CalibrationConfig(**TINY_FAST), {str(tmp_path / "a")!r}, loaded=loaded_tiny())
        assert res.artifact is not None and "world_size" not in res.report["timings"]
        assert not dist.is_initialized()
        assert "oscar_calib.calibration.parallel" not in sys.modules, "a single process entered calibration.parallel"
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]


@pytest.mark.slow
def test_smollm2_demo_artifact(demo_artifact):
    md, tensors = check_contract(demo_artifact, 30, 9, 3, 64)
    assert md["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and md["granularity"] == "head"
    assert md["group_size"] == "64" and md["composition"] == "u_h_pbr"
    report = json.loads((demo_artifact / "calibration.json").read_text())
    s = report["summary"]
    # the whole point: on held-out rows the calibrated rotations beat the Hadamard baseline
    assert s["mean_attn_error_oscar"] < s["mean_attn_error_hadamard"]
    assert s["layers_better_than_hadamard"] >= 25
    art = load_artifact(demo_artifact)
    assert art.num_layers == 30 and art.head_dim == 64


@pytest.mark.slow
def test_smollm2_rerun_byte_identical(tmp_path, demo_artifact, smollm2_loaded):
    res = calibrate(CalibrationConfig(**FAST), tmp_path / "again", loaded=smollm2_loaded)
    assert sha256(res.out / "oscar.safetensors") == sha256(demo_artifact / "oscar.safetensors")


def test_bit_budget_writes_per_layer_group_sizes(tmp_path, tiny_bit_budget):
    """--bit-budget: one layer of three gets groups of 32 (3 bits) within 2.7 bits on average, the
    artifact stores the sizes (and the closest uniform size as group_size) and validates."""
    from oscar_calib.runtime.scheme import KVScheme
    from oscar_calib.tools.validate import validate_artifact

    res = tiny_bit_budget
    md, _ = check_contract(res.out, 3, 4, 2, 64)
    sizes = [int(g) for g in md["layer_group_sizes"].split(",")]
    assert sorted(sizes) == [32, 64, 64] and md["group_size"] == "64"
    assert json.loads(md["calibration"])["bit_budget"] == 2.7
    b = res.report["bit_budget"]
    assert b["layer_group_sizes"] == sizes and b["mean_bits"] == pytest.approx((3 + 2.5 + 2.5) / 3)
    assert b["heldout_attn"]["per_layer"] < b["heldout_attn"]["uniform"]
    assert [r["k_group_size"] for r in res.report["layers"]] == sizes
    assert validate_artifact(res.out).ok
    assert KVScheme.from_artifact(res.out).k_groups == sizes
    # a budget that only affords the largest size writes a plain artifact
    plain = calibrate_tiny(tmp_path / "p", loaded=loaded_tiny("llama", head_dim=64, layers=3), bit_budget=2.5)
    assert "layer_group_sizes" not in plain.artifact.metadata and plain.artifact.metadata["group_size"] == "64"


def test_bit_budget_split_kv_writes_key_and_value_sizes(tmp_path):
    """--bit-budget 2.75 --split-kv on three layers of d = 64 (sizes 64: 2.5 bits, 32: 3 bits): keys
    and values move apart, three halvings of six caches fit (2.75 bits; one size per layer affords
    one layer, 2.667). The artifact stores both lists, validates, and every reader takes them."""
    from oscar_calib.runtime.scheme import KVScheme
    from oscar_calib.tools.validate import validate_artifact

    loaded = loaded_tiny("llama", head_dim=64, layers=3)
    res = calibrate_tiny(tmp_path / "s", loaded=loaded, bit_budget=2.75, split_kv=True)
    b = res.report["bit_budget"]
    groups = list(zip(b["layer_group_sizes"], b["layer_v_group_sizes"]))
    assert b["mean_bits"] == pytest.approx(2.75) and sum(g == 32 for pair in groups for g in pair) == 3
    assert [(r["k_group_size"], r["v_group_size"]) for r in res.report["layers"]] == groups
    md = res.artifact.metadata
    assert json.loads(md["calibration"])["split_kv"] is True and md["group_size"] == "64"
    assert validate_artifact(res.out).ok
    sch = KVScheme.from_artifact(res.out)
    assert list(zip(sch.k_groups, sch.v_groups)) == groups
    assert sch.bits_per_element == pytest.approx(2.75)
    tied = calibrate_tiny(tmp_path / "t", loaded=loaded, bit_budget=2.75)
    assert tied.report["bit_budget"]["mean_bits"] == pytest.approx(8 / 3)
    assert "layer_v_group_sizes" not in tied.artifact.metadata
    with pytest.raises(InputError, match="--split-kv .* needs --bit-budget"):
        CalibrationConfig(split_kv=True).validate()


def test_bit_budget_reuses_the_tables_fits_exactly(tmp_path, monkeypatch):
    """--bit-budget computes each layer's rotations once and takes the clips and held-out figures
    the budget's tables fitted at the chosen sizes: the artifact and the report's rows equal a
    from-scratch build_rotations at those sizes, and no clip is fitted outside the tables."""
    from oscar_calib.calibration import budget as budget_mod
    from oscar_calib.calibration import fit as fit_mod
    from oscar_calib.model.geometry import geometry_of

    fits = {"tables": 0, "outside": 0}
    real_tables, real_fit = budget_mod.budget_tables, fit_mod.fit_clips

    def counted_tables(*a, **k):
        fits["tables"] += 1
        return real_tables(*a, **k)

    def counted_fit(*a, **k):
        fits["outside"] += 1
        return real_fit(*a, **k)

    monkeypatch.setattr(budget_mod, "budget_tables", counted_tables)
    monkeypatch.setattr(fit_mod, "fit_clips", counted_fit)
    loaded = loaded_tiny("llama", head_dim=64, layers=3)
    res = calibrate_tiny(tmp_path / "b", loaded=loaded, bit_budget=2.7)
    assert fits == {"tables": 1, "outside": 0}
    cfg = CalibrationConfig(**{**TINY_FAST, "bit_budget": 2.7})
    groups = [(r["k_group_size"], r["v_group_size"]) for r in res.report["layers"]]
    assert sorted(g for g, _ in groups) == [32, 64, 64]
    layers, rows = fit_mod.build_rotations(res.stats, cfg, geometry_of(loaded.model), 64, groups=groups)
    assert fits["outside"] == 3
    for got, want in zip(res.artifact.layers, layers):
        for name in ("k_rotation", "v_rotation", "k_clip", "v_clip", "k_eigenvalues", "v_eigenvalues"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
    for got, want in zip(res.report["layers"], rows):
        for scheme in ("oscar", "hadamard"):   # ("fork" is added later, by the shared clips)
            assert got["heldout"][scheme] == want["heldout"][scheme]
        assert got["clip_tables"] == want["clip_tables"]


def test_bit_budget_settings_are_checked():
    for kw, msg in (({"bit_budget": 2.0}, "above 2"), ({"bit_budget": 2.5, "group_size": 32}, "leave out --group-size"),
                    ({"bit_budget": 2.5, "refine_steps": 2}, "cannot be combined")):
        with pytest.raises(InputError, match=msg):
            CalibrationConfig(**kw).validate()


def test_bit_budget_card_names_the_sizes(tiny_bit_budget):
    card = (tiny_bit_budget.out / "README.md").read_text()
    assert "group size per layer" in card and "bit budget 2.7" in card and "serves group 64" in card
