"""scripts/bench/bench_kernels.py, in this process: its --quick runs (tiny shapes, the Triton
interpreter) check, time and write every section; bad input and a machine without a GPU are one
line and exit non-zero, nothing written."""

import json

import pytest
import torch
from factories import load_script, quick_without_interpreter, script_error

from oscar_calib.kernels._common import interpreter_problem

pytestmark = pytest.mark.script
QUICK = pytest.mark.skipif(
    torch.cuda.is_available() or interpreter_problem() is not None,
    reason=str(interpreter_problem() or "--quick is the CPU smoke run; a GPU runs the benchmark"))


@pytest.fixture(scope="module")
def bench():
    return load_script("bench/bench_kernels.py")


@pytest.mark.parametrize("argv", [["--variants", "[1, 2]"], []])
def test_main_leaves_the_environment_as_it_found_it(bench, tmp_path, monkeypatch, argv):
    # without the interpreter, --quick is refused in one line (bad input first), nothing changed
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    msg = quick_without_interpreter(bench.main, tmp_path / "out", argv)
    assert ("TRITON_INTERPRET=1" in msg) == (not argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal; on a GPU the script benchmarks")
def test_without_gpu_says_so_in_one_line(bench, tmp_path):
    assert script_error(bench.main, ["--out", str(tmp_path)]) == (
        "error: no CUDA device here; the benchmark needs a GPU (--quick runs a CPU smoke test under the Triton "
        "interpreter)")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("bad, why", [
    (["--variants", "[1, 2]"], "must be a JSON list of config objects"),
    (["--variants", "[{"], "is not JSON"),
    (["--variants", "no-such-file.json"], "is neither a JSON list nor a file"),
    (["--variants", "[{}]", "--batches", "1,x"], "--batches '1,x': expected comma-separated"),
    (["--write-variants", "{}"], "--write-variants"),
    (["--save"], "--save accepts a full GPU run only"),
])
def test_bad_input_is_one_line_before_any_work(bench, tmp_path, bad, why):
    out = tmp_path / "out"
    msg = script_error(bench.main, ["--quick", "--out", str(out), *bad])
    assert msg.startswith("error: ") and why in msg and "\n" not in msg
    assert not out.exists()


@QUICK
def test_variant_sweep_quick(bench, tmp_path):
    # --variants: each config checked against the reference, then timed at every shape (the second
    # config: the benchmark's keys for a prerotated query on a paged cache)
    cfg = ('[{"mode": 0, "BLOCK_N": 16, "BLOCK16": 16, "programs_per_sm": 1}, '
           '{"mode": 0, "BLOCK_N": 16, "BLOCK16": 16, "bench_paged": 16, "bench_prerotated": true}]')
    assert bench.main(["--quick", "--out", str(tmp_path), "--variants", cfg, "--contexts", "88,152",
                       "--batches", "1"]) == 0
    rep = json.loads((tmp_path / "sweep.json").read_text())
    assert rep["benchmark"] == "kernels" and rep["device"] == "cpu"
    assert all(c["ok"] for c in rep["correctness"]["decode"]) and "write" not in rep["correctness"]
    rows = [r for r in rep["rows"] if "int2_ms" in r]
    assert {(r["context"], r["batch"], r["paged"]) for r in rows} == {(88, 1, None), (152, 1, None), (88, 1, 16),
                                                                      (152, 1, 16)}


@QUICK
def test_write_sweep_quick(bench, tmp_path, capsys):
    # --write-variants: each write config checked against the reference (including degenerate
    # rows), then timed; a config the kernel refuses fails its check and is not timed (entries may
    # carry their own clip ratios: one number, or one per head; the quick shape has 2)
    cfg = ('[{"late_clip": false, "select_top3": false, "sign_bits": false}, {"quantize": "bogus"}, '
           '{"select_top3": true, "clip_ratio": [0.85, 0.95]}, {"clip_ratio": [0.9]}, {"center": true}]')
    assert bench.main(["--quick", "--out", str(tmp_path), "--write-variants", cfg]) == 0
    rep = json.loads((tmp_path / "write_sweep.json").read_text())
    first, second, third, fourth, fifth = rep["write_check"]
    assert fifth["ok"] and fifth["no rot"]["codes_differing"] == 0     # key centering: the shift operand
    assert first["ok"] and first["no rot"]["codes_differing"] == 0 and first["no rot"]["params_identical"]
    assert not second["ok"] and "quantize" in second["error"]
    assert third["ok"] and third["no rot"]["codes_differing"] == 0 and third["no rot"]["params_identical"]
    assert not fourth["ok"] and "clip_ratio" in fourth["error"]
    assert [r["config"] for r in rep["rows"]] == [{"late_clip": False, "select_top3": False, "sign_bits": False},
                                                  {"select_top3": True, "clip_ratio": [0.85, 0.95]}, {"center": True}]
    assert all(r["ms"] > 0 for r in rep["rows"])
    # without "clip_ratio" the heads take the bundled zoo's ratios (spread, not all alike)
    zoo, own = rep["write_profile"][0]["clip_ratio"], rep["write_profile"][1]["clip_ratio"]
    assert len(zoo) == 2 and 0.85 <= zoo[0] < zoo[1] <= 0.99 and own == [0.85, 0.95]
    assert "of copy" in capsys.readouterr().out


@QUICK
def test_quick_run_writes_every_section_and_the_table(bench, tmp_path, capsys):
    # the whole --quick run: correctness first, every decode shape, the paged comparison, the
    # batch-1 breakdown, the write kernel; the result carries the harness's header
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "kernels-cpu.json").read_text())
    assert rep["benchmark"] == "kernels" and rep["device"] == "cpu" and rep["commit"] and rep["date"]
    assert rep["command"] == f"python scripts/bench/bench_kernels.py --quick --out {tmp_path}"
    assert rep["versions"]["torch"] == torch.__version__ and rep["versions"]["gpu"] is None
    assert rep["settings"]["quick"] and rep["settings"]["flush"] == "write"
    assert rep["correctness"]["write"]["codes_differing"] == 0.0
    assert all(r["ok"] for r in rep["correctness"]["decode"])
    assert {(r["context"], r["batch"]) for r in rep["rows"] if "int2_ms" in r} == {(88, 1), (152, 1)}
    assert all(r["sdpa_ms"] > 0 for r in rep["rows"])
    # each call also timed back to back with its copies (in stream), INT2 and SDPA alike
    assert all(r["int2_stream_ms"] > 0 and r["sdpa_stream_ms"] > 0 and r["stream_speedup"] > 0 for r in rep["rows"])
    (paged,) = rep["paged"]
    assert len(paged["rounds"]) == 1 and paged["median_ratio"] == paged["rounds"][0]["ratio"] > 0
    assert [w["name"] for w in rep["write"] if "ms" in w] == ["rot+clip"]
    # batch 1: the call with parts left out, each part alone, the floor
    assert [r["context"] for r in rep["breakdown"]] == [88]
    assert all(rep["breakdown"][0][p + "_ms"] > 0
               for p in ("call", "prerotated", "no_merge", "decode_only", "rotation_only", "floor"))
    out = capsys.readouterr().out
    assert "L2 flushed by a write before each call" in out and "batch 1, what each part adds" in out
    assert "median of 1 rounds" in out and "write rot+clip" in out and "correctness: write codes differing" in out
