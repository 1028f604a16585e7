"""What every GPU benchmark script (bench_kernels.py, bench_append.py) promises before it runs, in
this process: its --quick path refused in one line without the Triton interpreter, with the
process' environment as it was; on a machine without a GPU, one line and nothing written."""

import pytest
import torch
from factories import load_script, quick_without_interpreter, script_error

pytestmark = pytest.mark.script

# script, and an argv that is bad input for its --quick run (refused before the interpreter check)
SCRIPTS = [("bench/bench_kernels.py", ["--variants", "[1, 2]"]), ("bench/bench_append.py", ["--sections", "decode"])]


@pytest.mark.parametrize("bad_first", [True, False], ids=["bad-input", "plain"])
@pytest.mark.parametrize("script, bad", SCRIPTS, ids=[s for s, _ in SCRIPTS])
def test_main_leaves_the_environment_as_it_found_it(tmp_path, monkeypatch, script, bad, bad_first):
    # without the interpreter, --quick is refused in one line (bad input first), nothing changed
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    msg = quick_without_interpreter(load_script(script).main, tmp_path / "out", bad if bad_first else [])
    assert ("TRITON_INTERPRET=1" in msg) == (not bad_first)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal; on a GPU the script benchmarks")
@pytest.mark.parametrize("script", [s for s, _ in SCRIPTS])
def test_without_gpu_says_so_in_one_line(tmp_path, script):
    assert script_error(load_script(script).main, ["--out", str(tmp_path)]) == (
        "error: no CUDA device here; the benchmark needs a GPU (--quick runs a CPU smoke test under the Triton "
        "interpreter)")
    assert not any(tmp_path.iterdir())
