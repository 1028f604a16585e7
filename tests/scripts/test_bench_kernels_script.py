"""scripts/bench/bench_kernels.py, in this process: its --quick runs (tiny shapes, the Triton
interpreter) check, time and write every section; bad input is one line and
exits non-zero, nothing written (the no-GPU line: test_gpu_bench_common.py)."""

import json

import pytest
import torch
from factories import load_script, script_error

from oscar_calib.kernels._common import interpreter_problem

pytestmark = pytest.mark.script
QUICK = pytest.mark.skipif(
    torch.cuda.is_available() or interpreter_problem() is not None,
    reason=str(interpreter_problem() or "--quick is the CPU smoke run; a GPU runs the benchmark"))


@pytest.fixture(scope="module")
def bench():
    return load_script("bench/bench_kernels.py")


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
    # FlashInfer, the second baseline, cannot run here: the result, each row and the table say why
    assert not rep["flashinfer"]["available"] and rep["flashinfer"]["skipped"].startswith("FlashInfer ")
    assert all(r["flashinfer_skipped"] == rep["flashinfer"]["skipped"] for r in rep["rows"])
    out = capsys.readouterr().out
    assert f"FlashInfer BF16 decode (second baseline): not timed: {rep['flashinfer']['skipped']}" in out
    assert "L2 flushed by a write before each call" in out and "batch 1, what each part adds" in out
    assert "median of 1 rounds" in out and "write rot+clip" in out and "correctness: write codes differing" in out


# ------------------------------------------------------------------------------ FlashInfer baseline
@pytest.fixture(scope="module")
def fi_mod(bench):  # bench_kernels puts scripts/bench on sys.path for its parts
    return load_script("bench/kernels_flashinfer.py")


def test_flashinfer_not_importable_is_one_line(fi_mod):
    def missing(name):
        raise ModuleNotFoundError(f"No module named '{name}'")

    st = fi_mod.flashinfer_status(cuda=True, importer=missing)
    assert st == {"available": False,
                  "skipped": "FlashInfer not importable here (ModuleNotFoundError: No module named 'flashinfer')"}
    # importable but no GPU: also one line, with the version it found
    st = fi_mod.flashinfer_status(cuda=False, importer=lambda name: type("M", (), {"__version__": "9.9"}))
    assert not st["available"] and st["skipped"] == "FlashInfer 9.9 needs a CUDA device (this run is on the CPU)"
    st = fi_mod.flashinfer_status(cuda=True, importer=lambda name: type("M", (), {"__version__": "9.9"}))
    assert st["available"] and st["version"] == "9.9"


def test_flashinfer_page_table_places_every_token_once(fi_mod):
    # FlashInfer's paged layout (flashinfer-python 0.7.4, decode.py: indptr [B+1], indices of every
    # page, last_page_len in 1..page; cache [pages, 2, page, H, D], keys at [:, 0], values at [:, 1])
    lengths, page = [37, 16, 1], 16
    gen = torch.Generator().manual_seed(0)
    indptr, indices, last, total = fi_mod.page_table(lengths, page, "cpu", generator=gen)
    assert indptr.tolist() == [0, 3, 4, 5] and last.tolist() == [5, 16, 1] and total == 5
    assert sorted(indices.tolist()) == list(range(5)) and indices.dtype == torch.int32
    k = torch.randn(3, 37, 2, 4, generator=gen)
    v = torch.randn(3, 37, 2, 4, generator=gen)
    cache = fi_mod.paged_from_dense(k, v, lengths, indptr, indices, page)
    for b, n in enumerate(lengths):  # reading the pages back in table order gives each sequence
        pages = indices[indptr[b]:indptr[b + 1]].long()
        got_k = cache[pages, 0].reshape(-1, 2, 4)[:n]
        got_v = cache[pages, 1].reshape(-1, 2, 4)[:n]
        assert torch.equal(got_k, k[b, :n]) and torch.equal(got_v, v[b, :n])


def _fi_doc(timed: bool) -> dict:
    rows = []
    for b, c, i, s, f in ((1, 8192, 0.010, 0.020, 0.016), (1, 32768, 0.020, 0.050, 0.040)):
        r = {"context": c, "batch": b, "int2_ms": i, "sdpa_ms": s, "speedup": s / i, "int2_bytes": 1e6,
             "bf16_bytes": 8e6, "int2_bytes_per_s": 1e6 / (i * 1e-3), "sdpa_bytes_per_s": 8e6 / (s * 1e-3)}
        if timed and c == 8192:
            r.update(flashinfer_ms=f, flashinfer_stream_ms=f * 0.8, flashinfer_bytes_per_s=8e6 / (f * 1e-3),
                     flashinfer_speedup=f / i, flashinfer_stream_speedup=0.8 * f / i, flashinfer_vs_sdpa=s / f,
                     flashinfer_form="tensor_cores", flashinfer_tensor_cores_ms=f, flashinfer_cuda_cores_ms=2 * f)
        else:
            r["flashinfer_skipped"] = "error OutOfMemoryError: test" if timed else "FlashInfer not importable here"
        rows.append(r)
    forms = {"cuda_cores": {"ok": True, "backend": "fa2", "max_abs_diff": 0.0006},
             "tensor_cores": {"ok": True, "backend": "fa2", "max_abs_diff": 0.0012}}
    fi = ({"available": True, "version": "0.7.4", "page": 16, "forms": list(forms),
           "check": {"forms": forms, "max_abs_diff": 0.0012}} if timed
          else {"available": False, "skipped": "FlashInfer not importable here (ModuleNotFoundError: x)"})
    return {"device_name": "GPU", "copy": {"bytes_per_s": 4e12}, "rows": rows, "flashinfer": fi,
            "correctness": {"decode": [{"rel_err": 1e-3}]}}


@pytest.mark.parametrize("timed", [True, False])
def test_flashinfer_rows_in_the_table_and_the_report(bench, timed):
    # the printed table, the page's table and its note carry FlashInfer's time and the INT2 speed-up
    # over it per shape, or say in one line why not; a result that predates it says so too
    kr = load_script("bench/kernels_report.py")
    report = load_script("bench/report.py")
    doc = _fi_doc(timed)
    lines = kr.flashinfer_lines(doc, 4e12)
    page = "\n".join(report.kernels(doc))
    if timed:
        assert lines[0] == ("FlashInfer 0.7.4 BF16 decode, paged (page 16), second baseline, the faster form; "
                            "cuda_cores (fa2) max |diff| against SDPA 6.0e-04; tensor_cores (fa2) max |diff| "
                            "against SDPA 1.2e-03:")
        assert lines[2].split() == ["8192", "1", "16.0", "12%", "1.60", "1.25", "|", "12.8", "1.28", "|", "32.0",
                                    "16.0"]
        assert lines[3].split()[:2] == ["32768", "1"] and "not timed: error OutOfMemoryError" in lines[3]
        head = page.splitlines()[2]
        assert "FlashInfer BF16 µs (baseline 2)" in head and "speed-up vs FlashInfer" in head
        assert "| 8K | 1 | 10.0 | 20.0 | **2.00×** | 2% | 10% | 16.0 | **1.60×** | 12% |" in page
        assert "| 32K | 1 | 20.0 | 50.0 | **2.50×** | 1% | 4% | – | – | – |" in page
        assert ("FlashInfer 0.7.4 BF16 decode: `BatchDecodeWithPagedKVCacheWrapper`, page 16, the faster of its "
                "forms at each shape: CUDA-core decode kernel (`fa2`, max |diff| against float32 SDPA 6.0e-04): "
                "none; tensor cores (`use_tensor_cores=True`) (`fa2`, max |diff| against float32 SDPA 1.2e-03): "
                "8K × 1; not timed at 32K × 1 (error OutOfMemoryError: test).") in page
    else:
        assert lines == ["FlashInfer BF16 decode (second baseline): not timed: FlashInfer not importable here "
                         "(ModuleNotFoundError: x)"]
        assert "FlashInfer BF16 µs" not in page
        assert ("- FlashInfer's BF16 decode (second baseline): not timed in this run: FlashInfer not importable "
                "here (ModuleNotFoundError: x).") in page
    del doc["flashinfer"]
    assert kr.flashinfer_lines(doc, 4e12) == []
    assert "not in this result (its run predates the baseline)" in "\n".join(report.kernels(doc))


def test_flashinfer_series_in_the_decode_figures(bench):
    plots = load_script("bench/plots.py")
    doc = _fi_doc(True)
    for r in doc["rows"]:
        r.update(int2_stream_ms=r["int2_ms"], sdpa_stream_ms=r["sdpa_ms"])
    svg = plots.decode_time(doc)
    assert "FlashInfer BF16 (one call)" in svg and "FlashInfer in stream" in svg and "and FlashInfer" in svg
    assert svg.count("<polyline") == 6                            # INT2, SDPA, FlashInfer x one call, in stream
    assert "FlashInfer BF16, batch 1" in plots.decode_bandwidth(doc)
    assert "FlashInfer" not in plots.decode_time(_fi_doc(False))
