"""scripts/bench/bench_kernels.py on a machine without a GPU: one line and a non-zero exit unless --quick."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oscar_calib.kernels._common import interpreter_problem

pytestmark = pytest.mark.script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "bench_kernels.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal; on a GPU the script benchmarks")
def test_bench_kernels_without_gpu_says_so_in_one_line(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines == ["error: no CUDA device here; the benchmark needs a GPU (--quick runs a CPU smoke test under "
                     "the Triton interpreter)"]
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.skipif(interpreter_problem() is not None, reason=str(interpreter_problem()))
def test_bench_kernels_variant_sweep_quick(tmp_path):
    # --variants: each config checked against the reference, then timed at every shape (CPU
    # interpreter under --quick); bad input is one line and a non-zero exit, nothing written
    # (the second config: the benchmark's keys for a prerotated query on a paged cache)
    cfg = ('[{"mode": 0, "BLOCK_N": 16, "BLOCK16": 16, "programs_per_sm": 1}, '
           '{"mode": 0, "BLOCK_N": 16, "BLOCK16": 16, "bench_paged": 16, "bench_prerotated": true}]')
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path), "--variants", cfg,
                          "--contexts", "360,704", "--batches", "2"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rep = json.loads((tmp_path / "sweep.json").read_text())
    assert all(c["ok"] for c in rep["correctness"]["decode"])
    rows = [r for r in rep["variants"] if "int2_ms" in r]
    assert {(r["context"], r["batch"], r["paged"]) for r in rows} == {
        (360, 2, None), (704, 2, None), (360, 2, 16), (704, 2, 16)}
    for bad, why in ((["--variants", "[1, 2]"], "must be a JSON list of config objects"),
                     (["--variants", "[{"], "is not JSON"),
                     (["--variants", "no-such-file.json"], "is neither a JSON list nor a file"),
                     (["--variants", "[{}]", "--batches", "1,x"], "--batches '1,x': expected comma-separated")):
        out = tmp_path / "bad"
        res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out), *bad],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode != 0
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and why in lines[0], res.stderr
        assert not out.exists()


@pytest.mark.skipif(interpreter_problem() is not None, reason=str(interpreter_problem()))
def test_bench_kernels_write_sweep_quick(tmp_path):
    # --write-variants: each write config checked against the reference (including degenerate
    # rows), then timed; a config the kernel refuses fails its check and is not timed
    # (entries may carry their own clip ratios: one number, or one per head; the quick shape has 2)
    cfg = ('[{"late_clip": false, "select_top3": false, "sign_bits": false}, {"quantize": "bogus"}, '
           '{"select_top3": true, "clip_ratio": [0.85, 0.95]}, {"clip_ratio": [0.9]}]')
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path), "--write-variants", cfg],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rep = json.loads((tmp_path / "write_sweep.json").read_text())
    first, second, third, fourth = rep["write_check"]
    assert first["ok"] and first["no rot"]["codes_differing"] == 0 and first["no rot"]["params_identical"]
    assert not second["ok"] and "quantize" in second["error"]
    assert third["ok"] and third["no rot"]["codes_differing"] == 0 and third["no rot"]["params_identical"]
    assert not fourth["ok"] and "clip_ratio" in fourth["error"]
    assert [r["config"] for r in rep["write_sweep"]] == [{"late_clip": False, "select_top3": False, "sign_bits": False},
                                                         {"select_top3": True, "clip_ratio": [0.85, 0.95]}]
    assert all(r["ms"] > 0 for r in rep["write_sweep"])
    # without "clip_ratio" the heads take the bundled zoo's ratios (spread, not all alike)
    zoo, own = rep["write_profile"][0]["clip_ratio"], rep["write_profile"][1]["clip_ratio"]
    assert len(zoo) == 2 and 0.85 <= zoo[0] < zoo[1] <= 0.99 and own == [0.85, 0.95]
    assert "of copy" in res.stdout
    out = tmp_path / "bad"
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--write-variants", "{}"],
                         capture_output=True, text=True, timeout=120)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode != 0 and len(lines) == 1 and "--write-variants" in lines[0], res.stderr
    assert not out.exists()


@pytest.mark.skipif(interpreter_problem() is not None, reason=str(interpreter_problem()))
def test_bench_kernels_quick_run_writes_json_and_table(tmp_path):
    # the whole --quick run (CPU interpreter): correctness first, every decode shape, the paged
    # comparison in rounds, the write kernel; the JSON and the printed table agree
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rep = json.loads((tmp_path / "bench_kernels.json").read_text())
    assert rep["quick"] and rep["correctness"]["write"]["codes_differing"] == 0.0
    assert rep["flush"] == "write" and "L2 flushed by a write before each call" in res.stdout
    assert all(r["ok"] for r in rep["correctness"]["decode"])
    assert {(r["context"], r["batch"]) for r in rep["decode"] if "int2_ms" in r} == {(360, 1), (704, 1), (360, 2),
                                                                                      (704, 2)}
    (paged,) = rep["paged"]
    assert len(paged["rounds"]) == 1 and paged["median_ratio"] == paged["rounds"][0]["ratio"] > 0
    assert [w["name"] for w in rep["write"] if "ms" in w] == ["rot+clip"]
    # batch 1: the call with parts left out, each part alone, the floor
    assert [r["context"] for r in rep["breakdown"]] == [360, 704]
    assert all(r[p + "_ms"] > 0 for r in rep["breakdown"]
               for p in ("call", "prerotated", "no_merge", "decode_only", "rotation_only", "floor"))
    out = res.stdout
    assert "batch 1, what each part adds" in out
    assert "median of 1 rounds" in out and "write rot+clip" in out and "correctness: write codes differing" in out
