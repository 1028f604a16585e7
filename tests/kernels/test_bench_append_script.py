"""scripts/bench/bench_append.py: a CPU smoke run under --quick, one line and a non-zero exit without a GPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oscar_calib.kernels._common import interpreter_problem

pytestmark = pytest.mark.script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "bench_append.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal; on a GPU the script benchmarks")
def test_bench_append_without_gpu_says_so_in_one_line(tmp_path):
    out = tmp_path / "b.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and not out.exists()
    assert [ln for ln in res.stderr.splitlines() if ln.strip()] == [
        "error: no CUDA device here; the benchmark needs a GPU (--quick runs a CPU smoke test under the Triton "
        "interpreter)"]


@pytest.mark.skipif(interpreter_problem() is not None, reason=str(interpreter_problem()))
def test_bench_append_quick_times_every_variant(tmp_path):
    out = tmp_path / "b.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(out.read_text())
    variants = [r["variant"] for r in data["rows"]]
    assert variants[0] == "default" and "torch reference" in variants and len(variants) == len(set(variants))
    assert all(r["us_per_call"] > 0 for r in data["rows"])
    methods = [r["method"] for r in data["step"]]
    assert methods == ["rotation kernel", "in append_token", "in append_token, no PDL", "BF16 cache + SDPA"]
    # the three ways of rotating the query give the same attention output (bf16 outputs: up to their
    # rounding; a wrong query would be off by order 1)
    assert all(r["us_per_layer"] > 0 for r in data["step"])
    assert all(r["rel_diff_vs_rotation_kernel"] < 1e-2 for r in data["step"][:3])


def test_bench_append_refuses_unknown_sections(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--sections", "decode", "--out",
                          str(tmp_path / "b.json")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--sections" in res.stderr and not (tmp_path / "b.json").exists()
