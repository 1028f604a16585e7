"""Data-parallel calibration on the CPU (gloo, 2 processes through torch's elastic launcher) and
big-model placement (accelerate device maps with disk offload).

Every multi-process test starts real ranks (tests/dist_worker.py, or the CLI re-executed by
``--nproc``); each rank builds the same seeded tiny model. The single-process references run here
with one thread, as the ranks do, so activations are bit-identical and only the order of the
float64 additions differs.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from factories import TESTS, assert_one_line_error, loaded_tiny, oscar
from safetensors.torch import load_file

from oscar_calib.calibration.checkpoint import CHECKPOINT_NAME
from oscar_calib.calibration.pipeline import calibrate
from oscar_calib.calibration.stats import ACCUMULATORS
from oscar_calib.contract.config import CalibrationConfig
from oscar_calib.errors import DistributedError, InputError
from oscar_calib.jobs.launch import check_nproc, launch
from oscar_calib.model.placement import (
    Placement,
    parse_device_map,
    parse_max_memory,
    placement_from_options,
)
from oscar_calib.numerics.rotation import eig_desc

WORKER = TESTS / "dist_worker.py"
# 16 sequences of 64 tokens, 2 per batch: 8 batches, 4 per rank. The sst-approx pilot (384 tokens)
# is the first 3 batches: 2 of them on rank 0, 1 on rank 1.
CFG = dict(tokens=1024, seq_len=64, batch_size=2, heldout_tokens=48, pilot_tokens=384, checkpoint_every=1,
           device="cpu", v_objective="sst-approx")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process run over the same tokens, one thread (as every rank)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = calibrate(CalibrationConfig(**CFG), tmp_path_factory.mktemp("ref") / "out", loaded=loaded_tiny())
    finally:
        torch.set_num_threads(threads)
    return res


def run_job(tmp_path: Path, name: str, nproc: int = 2, **job) -> tuple[int, Path]:
    work = tmp_path / name
    work.mkdir()
    job = {"cfg": CFG, "out": str(tmp_path / "out"), "work": str(work), **job}
    (work / "job.json").write_text(json.dumps(job))
    return launch(nproc, [sys.executable, str(WORKER), str(work / "job.json")]), work


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def assert_matches_reference(stats: list[dict], reference) -> None:
    for layer, (got, ref) in enumerate(zip(stats, reference.stats.stats)):
        assert got["tokens"] == ref.tokens
        for name in ACCUMULATORS:
            r = rel(got["sums"][name], ref.sums[name])
            assert r <= 1e-12, (layer, name, r)
        assert rel(got["w_sum"], ref.w_sum) <= 1e-12
        assert rel(got["pilot_cq"], ref.pilot_cq) <= 1e-12
        for name, count in (("q", ref.tokens * ref.group), ("s", ref.tokens * ref.group),
                            ("s_approx", None)):
            cov = got["sums"][name] / (count or got["w_sum"].view(-1, 1, 1))
            _, u = eig_desc(cov)
            _, u_ref = eig_desc(ref.covariance(name))
            # same eigenvectors up to sign: |<u_i, u_ref_i>| = 1
            dots = (u * u_ref).sum(-2).abs()
            assert float((dots - 1).abs().max()) < 1e-8, (layer, name)


def assert_same_rows(rows: list[dict], ref_rows: list[dict]) -> None:
    """calibration.json's per-layer rows: the same clips and clip tables, held-out figures (OSCAR's,
    Hadamard's, the shared scheme's) equal to float64 summation order."""
    assert [r["layer"] for r in rows] == [r["layer"] for r in ref_rows] == list(range(len(ref_rows)))
    for got, want in zip(rows, ref_rows):
        assert got["k_clip"] == want["k_clip"] and got["v_clip"] == want["v_clip"]
        assert set(got["heldout"]) == set(want["heldout"]) == {"oscar", "hadamard", "fork"}
        for scheme, figures in want["heldout"].items():
            for name, value in figures.items():
                assert got["heldout"][scheme][name] == pytest.approx(value, rel=1e-9), (got["layer"], scheme, name)


def assert_same_rotations(out: Path, ref_out: Path) -> None:
    a, b = load_file(str(out / "oscar.safetensors")), load_file(str(ref_out / "oscar.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k


def fitted_alone(tmp_path: Path, cfg: dict, saved: list[dict], monkeypatch, **model) -> Path:
    """One process (one thread, as every rank) that captures as usual, then takes a job's
    all-reduced accumulators ``saved`` in place of its own and fits every layer itself: its
    artifact is what the job's ranks, each fitting its share of the layers, must write byte for byte."""
    from oscar_calib.calibration import pipeline
    from oscar_calib.calibration.ranks import Ranks

    class TakesTheJobsSums(Ranks):
        def reduce(self, stats):
            for s, state in zip(stats, saved):
                s.load_state_dict(state)

    monkeypatch.setattr(pipeline, "Ranks", TakesTheJobsSums)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return calibrate(CalibrationConfig(**cfg), tmp_path / "alone", loaded=loaded_tiny(**model)).out
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_two_ranks_equal_one_process(tmp_path, reference, monkeypatch):
    code, work = run_job(tmp_path, "job")
    assert code == 0
    got = torch.load(work / "stats.pt", weights_only=True)
    assert_matches_reference(got["stats"], reference)
    assert got["timings"]["world_size"] == 2 and got["timings"]["rank_batches"] == 4
    out = tmp_path / "out"
    assert_same_rotations(out, reference.out)
    report = json.loads((out / "calibration.json").read_text())
    assert report["calibration"] == reference.report["calibration"]      # same tokens (sha256), settings, pilot
    assert_same_rows(report["layers"], reference.report["layers"])
    assert not list(out.glob(".oscar-checkpoint*"))
    # the fitting after the capture is split by layer: each rank fits one of the two layers, and
    # together they write what one process fits from the same accumulators
    assert [json.loads((work / f"fitting.rank{r}").read_text()) for r in (0, 1)] == [[0], [1]]
    assert got["timings"]["fitted_layers"] == 1
    alone = fitted_alone(tmp_path, CFG, got["stats"], monkeypatch)
    assert (out / "oscar.safetensors").read_bytes() == (alone / "oscar.safetensors").read_bytes()
    assert report["layers"] == json.loads((alone / "calibration.json").read_text())["layers"]


@pytest.mark.slow
def test_two_ranks_split_a_bit_budget_as_one_process(tmp_path, monkeypatch):
    """--bit-budget under 2 ranks: each rank builds the error tables of its layers (0 and 2, or 1),
    the ranks exchange them and allocate alike; the artifact, per-layer group sizes included, is
    the one one process fits from the same accumulators."""
    cfg, model = dict(CFG, bit_budget=2.7, v_objective="sst"), {"head_dim": 64, "layers": 3}
    code, work = run_job(tmp_path, "job", cfg=cfg, model=model)
    assert code == 0
    assert [json.loads((work / f"fitting.rank{r}").read_text()) for r in (0, 1)] == [[0, 2], [1]]
    out = tmp_path / "out"
    alone = fitted_alone(tmp_path, cfg, torch.load(work / "stats.pt", weights_only=True)["stats"], monkeypatch,
                         **model)
    assert (out / "oscar.safetensors").read_bytes() == (alone / "oscar.safetensors").read_bytes()
    report, want = (json.loads((d / "calibration.json").read_text()) for d in (out, alone))
    assert report["bit_budget"] == want["bit_budget"] and len(set(report["bit_budget"]["layer_group_sizes"])) == 2
    assert report["layers"] == want["layers"]


@pytest.mark.slow
def test_dead_rank_is_named_and_resume_continues(tmp_path, reference):
    out = tmp_path / "out"
    with pytest.raises(DistributedError, match=r"rank 1 died \(SIGKILL\); rank\(s\) 0 were stopped"):
        run_job(tmp_path, "dies", die={"1": 2})
    work = tmp_path / "dies"
    # the survivor exits with one clear line, the dead rank's checkpoint stays, nothing else is written
    assert "rank 0:" in (work / "error.rank0").read_text()
    assert (out / f"{CHECKPOINT_NAME[:-3]}.rank1-of-2.pt").exists()
    assert not (out / "oscar.safetensors").exists()
    # a single process cannot take over a 2-rank checkpoint
    with pytest.raises(InputError, match="another number of ranks"):
        calibrate(CalibrationConfig(**CFG), out, loaded=loaded_tiny(), resume=True)
    code, work = run_job(tmp_path, "resume", resume=True)
    assert code == 0
    assert json.loads((work / "batches.rank1").read_text())[0] == 3      # rank 1 went on after batch 2
    assert_matches_reference(torch.load(work / "stats.pt", weights_only=True)["stats"], reference)
    assert_same_rotations(out, reference.out)
    assert not list(out.glob(".oscar-checkpoint*"))


@pytest.mark.parametrize("rank", [0, 1])
def test_mismatched_models_stop_every_rank(tmp_path, monkeypatch, rank):
    """Each rank sees every rank's fingerprint (the all-gather itself runs in the tests above);
    here the other rank loaded another revision: every rank stops before writing anything."""
    import contextlib

    from oscar_calib.calibration import parallel
    from oscar_calib.jobs.session import DistContext

    class TwoRanks(DistContext):
        def gather_objects(self, obj, what):
            other = dict(obj, fingerprint="0" * 64)                  # "another revision" on the other rank
            return [obj, other] if self.rank == 0 else [other, obj]

    monkeypatch.setenv("WORLD_SIZE", "2")                             # this process is one rank of two
    monkeypatch.setattr(parallel, "session", lambda *a, **k: contextlib.nullcontext(
        TwoRanks(rank=rank, world_size=2, device="cpu", backend="gloo")))
    with pytest.raises(DistributedError, match="ranks disagree on the model fingerprint .*rank 0: .*rank 1: "):
        calibrate(CalibrationConfig(**CFG), tmp_path / "out", loaded=loaded_tiny())
    assert not (tmp_path / "out").exists()                                  # nothing half-written


@pytest.mark.slow
def test_cli_nproc_two_equals_one(tmp_path, tiny_dir, plain_artifact):
    out = tmp_path / "dp"
    code, _, err = oscar("calibrate", str(tiny_dir), "--out", str(out), *CLI_ARGS,
                         "--nproc", "2", "--json")
    assert code == 0, err
    assert_same_rotations(out, plain_artifact)
    t = json.loads((out / "calibration.json").read_text())["timings"]
    assert t["world_size"] == 2


def test_nproc_beyond_devices_is_refused(monkeypatch, tmp_path, tiny_dir):
    code, _, err = oscar("calibrate", str(tiny_dir), "--out", str(tmp_path / "o"),
                         *CLI_ARGS, "--nproc", "4096")
    assert_one_line_error(code, err, "--nproc 4096: only")
    assert "CPU core" in err and not (tmp_path / "o").exists()
    code, _, err = oscar("calibrate", str(tiny_dir), "--out", str(tmp_path / "o"),
                         *CLI_ARGS, "--nproc", "0")
    assert_one_line_error(code, err, "--nproc must be at least 1")
    # on CUDA the devices are the visible GPUs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(InputError, match="--nproc 2: only 1 CUDA device"):
        check_nproc(2, "cuda")
    check_nproc(1, "cuda")


def test_half_precision_grams_match_float64(monkeypatch):
    """bf16 activations take the batched float32-output GEMM (exact products); float64 is forced by
    OSCAR_EXACT_GRAMS=1. They agree to float32 summation error; float32 inputs never take it."""
    from oscar_calib.calibration.stats import LayerStats, half_precision_grams

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 6, 96, 16, generator=gen).bfloat16()
    k, v = (torch.randn(2, 2, 96, 16, generator=gen).bfloat16() for _ in range(2))
    o = torch.randn(2, 96, 6, 16, generator=gen).bfloat16()
    fast, exact = LayerStats(2, 3, 16, 64), LayerStats(2, 3, 16, 64)
    assert half_precision_grams(q, k, v, o) and not half_precision_grams(q.float(), k, v, o)
    fast.update(q, k, v, o)
    monkeypatch.setenv("OSCAR_EXACT_GRAMS", "1")
    assert not half_precision_grams(q, k, v, o)
    exact.update(q, k, v, o)
    for name in ACCUMULATORS:
        assert rel(fast.sums[name], exact.sums[name]) < 1e-6, name
    assert fast.tokens == exact.tokens == 192


def test_bad_placement_options():
    assert parse_max_memory("0=70GiB, cuda:1=60GB,cpu=200GiB,disk=1000") == {0: "70GiB", 1: "60GB", "cpu": "200GiB",
                                                                            "disk": 1000}
    for bad, pattern in (("0:70GiB", "DEVICE=SIZE"), ("tpu=1GiB", "unknown device"), ("0=lots", "not a size")):
        with pytest.raises(InputError, match=pattern):
            parse_max_memory(bad)
    assert parse_device_map("auto") == "auto" and parse_device_map('{"": "cpu"}') == {"": "cpu"}
    with pytest.raises(InputError, match="--device-map"):
        parse_device_map("everywhere")
    assert placement_from_options("auto", "0=1GiB", None) == Placement("auto", {0: "1GiB"}, None)
    assert placement_from_options(None, None, None) is None
    with pytest.raises(InputError, match="--max-memory needs --device-map"):
        placement_from_options(None, "0=1GiB", None)


def test_a_rank_with_a_device_map_gets_its_slice_of_the_gpus(monkeypatch):
    from oscar_calib.jobs.session import rank_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert rank_device("cuda", 1, Placement("auto")) == ("nccl", "cuda:2")     # GPUs 2 and 3
    assert rank_device("cuda", 1, None) == ("nccl", "cuda:1")                  # one GPU per rank
    with pytest.raises(DistributedError, match="LOCAL_RANK=2 has no GPU"):
        rank_device("cuda", 2, Placement("auto"))


# ----------------------------------------------------------------------------- big models

CLI_ARGS = ["--tokens", "512", "--seq-len", "64", "--batch-size", "2", "--heldout-tokens", "48", "--device", "cpu",
            "--no-verify"]


def test_device_map_with_disk_offload_equals_plain_run(tmp_path, tiny_dir, plain_artifact):
    cfg = CalibrationConfig(model=str(tiny_dir), tokens=512, seq_len=64, batch_size=2, heldout_tokens=48, device="cpu")
    # ~1.5 decoder layers fit in "CPU memory": the rest is offloaded to disk (read from the safetensors)
    res = calibrate(cfg, tmp_path / "big", placement=Placement("auto", {"cpu": 200_000}))
    where = set(res.loaded.model.hf_device_map.values())
    assert "disk" in where, res.loaded.model.hf_device_map
    assert_same_rotations(tmp_path / "big", plain_artifact)
    res = calibrate(cfg, tmp_path / "cpu", placement=Placement({"": "cpu"}))
    assert (tmp_path / "cpu" / "oscar.safetensors").read_bytes() == (plain_artifact / "oscar.safetensors").read_bytes()


def test_offload_dir_is_used_and_result_unchanged(tmp_path, tiny_dir, plain_artifact, monkeypatch):
    import transformers

    seen = {}
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*a, **kw):
        seen.update(kw)
        return real(*a, **kw)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    cfg = CalibrationConfig(model=str(tiny_dir), tokens=512, seq_len=64, batch_size=2, heldout_tokens=48, device="cpu")
    off = tmp_path / "offload"
    res = calibrate(cfg, tmp_path / "big", placement=Placement("auto", {"cpu": 200_000}, str(off)))
    assert seen["offload_folder"] == str(off) and seen["device_map"] == "auto"
    assert "disk" in set(res.loaded.model.hf_device_map.values())
    assert_same_rotations(tmp_path / "big", plain_artifact)


def test_offload_dir_bad_input(tmp_path, tiny_dir):
    code, _, err = oscar("calibrate", str(tiny_dir), "--out", str(tmp_path / "o"),
                         *CLI_ARGS, "--offload-dir", str(tmp_path / "off"))
    assert_one_line_error(code, err, "--offload-dir needs --device-map")
    (tmp_path / "afile").write_text("x")
    code, _, err = oscar("calibrate", str(tiny_dir), "--out", str(tmp_path / "o"),
                         *CLI_ARGS, "--device-map", "auto", "--offload-dir", str(tmp_path / "afile"))
    assert_one_line_error(code, err, "is a file, not a folder")
    assert not (tmp_path / "o").exists() and (tmp_path / "afile").read_text() == "x"
