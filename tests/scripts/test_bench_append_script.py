"""scripts/bench/bench_append.py, in this process: a --quick run (one small layer, the Triton
interpreter) times every variant and the step section and writes its result; bad input is one line
and exits non-zero, nothing written (the no-GPU line: test_gpu_bench_common.py)."""

import json

import pytest
import torch
from factories import load_script, script_error

from oscar_calib.kernels._common import interpreter_problem

pytestmark = pytest.mark.script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench/bench_append.py")


@pytest.mark.parametrize("bad, why", [(["--sections", "decode"], "--sections takes append and step"),
                                      (["--save"], "--save accepts a GPU run only")])
def test_bad_input_is_one_line(bench, tmp_path, bad, why):
    assert why in script_error(bench.main, ["--quick", "--out", str(tmp_path / "out"), *bad])
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available() or interpreter_problem() is not None,
                    reason=str(interpreter_problem() or "--quick is the CPU smoke run; a GPU runs the benchmark"))
def test_quick_times_every_variant_and_the_step(bench, tmp_path):
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "append-cpu.json").read_text())
    assert data["benchmark"] == "append" and data["settings"]["quick"] and data["not_measured"] == []
    variants = [r["variant"] for r in data["rows"]]
    assert variants == list(bench.VARIANTS)
    assert all(r["us_per_call"] > 0 for r in data["rows"])
    methods = [r["method"] for r in data["step"]]
    assert methods == ["rotation kernel", "in append_token", "in append_token, no PDL", "BF16 cache + SDPA"]
    # the three ways of rotating the query give the same attention output (bf16 outputs: up to their
    # rounding; a wrong query would be off by order 1)
    assert all(r["us_per_layer"] > 0 for r in data["step"])
    assert all(r["rel_diff_vs_rotation_kernel"] < 1e-2 for r in data["step"][:3])
