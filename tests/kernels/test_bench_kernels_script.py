"""scripts/bench_kernels.py on a machine without a GPU: one line and a non-zero exit unless --quick."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_kernels.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal; on a GPU the script benchmarks")
def test_bench_kernels_without_gpu_says_so_in_one_line(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines == ["error: no CUDA device here; the benchmark needs a GPU (--quick runs a CPU smoke test under "
                     "the Triton interpreter)"]
    assert not any(tmp_path.iterdir())  # nothing written
