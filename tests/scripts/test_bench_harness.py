"""scripts/bench/harness.py (device slugs, the CPU timing path, the result format, installing a current
result) and scripts/bench/report.py: the committed docs/benchmarks.md is the rendering of the
committed results, and every current result carries its device, commit, date and command."""

import json
import os

import pytest
from factories import REPO, left_as_found, load_script

pytestmark = pytest.mark.script


@pytest.fixture(scope="module")
def harness():
    return load_script("bench/harness.py")


@pytest.mark.parametrize("name, count, slug", [("NVIDIA H100 80GB HBM3", 1, "h100"), ("NVIDIA H200", 1, "h200"),
                                               ("NVIDIA H100 80GB HBM3", 4, "h100x4"), ("NVIDIA H200", 2, "h200x2"),
                                               ("NVIDIA A100-SXM4-80GB", 1, "a100"), ("NVIDIA L40S", 1, "l40s"),
                                               ("cpu (x86_64)", 1, "cpu")])
def test_device_slug(harness, name, count, slug):
    assert harness.device_slug(name, count) == slug


@pytest.mark.parametrize("argv, chosen", [(["--quick"], "1"), ([], None)])
def test_a_program_chooses_the_interpreter_before_main_runs(harness, monkeypatch, argv, chosen):
    # run_program (the scripts' __main__) sets TRITON_INTERPRET for a --quick run, in the program's
    # own process; here os.environ is a copy, so the test's process keeps its own
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    monkeypatch.setattr("sys.argv", ["bench_kernels.py", *argv])
    seen = []
    with pytest.raises(SystemExit) as e:
        harness.run_program(lambda: seen.append(os.environ.get("TRITON_INTERPRET")) or 3)
    assert e.value.code == 3 and seen == [chosen]


def test_left_as_found_names_what_a_block_leaves_changed(monkeypatch):
    # the check every test runs under (conftest): a variable left set fails, one set and restored passes
    monkeypatch.delenv("OSCAR_TEST_LEAK", raising=False)
    with pytest.raises(AssertionError, match="OSCAR_TEST_LEAK"):
        with left_as_found(whole=False):
            os.environ["OSCAR_TEST_LEAK"] = "1"
    del os.environ["OSCAR_TEST_LEAK"]
    with pytest.raises(AssertionError, match="SOME_SCRIPT_VAR"):
        with left_as_found(whole=True):
            os.environ["SOME_SCRIPT_VAR"] = "1"
    del os.environ["SOME_SCRIPT_VAR"]
    with left_as_found(whole=True):
        os.environ["SOME_SCRIPT_VAR"] = "1"
        del os.environ["SOME_SCRIPT_VAR"]


def test_left_as_found_names_torch_settings_and_the_directory_a_block_leaves_changed(tmp_path):
    import torch

    threads, here = torch.get_num_threads(), os.getcwd()
    try:
        with pytest.raises(AssertionError, match="torch threads"):
            with left_as_found(whole=False):
                torch.set_num_threads(threads + 1)
    finally:
        torch.set_num_threads(threads)
    try:
        with pytest.raises(AssertionError, match="working directory"):
            with left_as_found(whole=False):
                os.chdir(tmp_path)
    finally:
        os.chdir(here)
    with left_as_found(whole=False), torch.no_grad():         # changed and restored inside: passes
        torch.set_num_threads(threads + 1)
        torch.set_num_threads(threads)


def test_cpu_timing_calls_each_copy_in_turn(harness):
    calls = []
    fns = [lambda i=i: calls.append(i) for i in range(3)]
    assert harness.graph_ms(fns, cuda=False, cpu_reps=4) >= 0
    assert calls == [0, 1, 2, 0]                        # no warm-up on the CPU, the copies in rotation
    assert harness.rotating_copies(10 << 20, 50 << 20, cuda=True) == 15
    assert harness.rotating_copies(200 << 20, 50 << 20, cuda=True) == 1
    assert harness.rotating_copies(1, 50 << 20, cuda=True) == 16 and harness.rotating_copies(1, 4, cuda=False) == 1


def _doc(harness, **over):
    dev = harness.Device(name="NVIDIA H100 80GB HBM3", slug="h100", cuda=True)
    doc = harness.new_result("append", dev, script=REPO / "scripts/bench/bench_append.py", argv=["--sections", "step"],
                             settings={"quick": False})
    doc.update(over)
    return doc


def test_new_result_header(harness):
    doc = _doc(harness)
    assert doc["command"] == "python scripts/bench/bench_append.py --sections step"
    assert doc["device"] == "h100" and doc["commit"] and doc["date"].endswith("+00:00")
    assert set(doc["versions"]) == {"python", "torch", "triton", "transformers", "cuda", "gpu"}
    assert harness.check_result(doc) is doc
    with pytest.raises(ValueError, match="missing commit"):
        harness.check_result({k: v for k, v in doc.items() if k != "commit"})
    with pytest.raises(ValueError, match="benchmark 'nope'"):
        harness.new_result("nope", harness.Device(name="cpu", slug="cpu"), script="x.py", argv=[])


def test_the_commit_given_wins_over_a_copied_trees_git(harness, tmp_path):
    """``$OSCAR_BENCH_COMMIT`` names the tree a GPU machine holds, whatever its (possibly lagging)
    ``.git`` says; without it, git's answer; without either, ``unknown``."""
    assert harness.git_commit(env={"OSCAR_BENCH_COMMIT": "abc1234"}) == "abc1234"
    mine = harness.git_commit(env={})
    assert mine != "abc1234" and mine.split("+")[0] and mine != "unknown"       # this checkout's own
    assert harness.git_commit(tmp_path, env={}) == "unknown"                    # no git here


def test_install_keeps_the_sections_a_run_did_not_measure(harness, tmp_path):
    first = _doc(harness, rows=[{"variant": "default", "us_per_call": 6.0}], step=[{"method": "a"}], not_measured=[])
    path = harness.install_result(first, tmp_path)
    assert path == tmp_path / "append-h100.json"
    second = _doc(harness, rows=[], step=[{"method": "b"}], not_measured=["rows"], commit="abc1234")
    harness.install_result(second, tmp_path)
    got = json.loads(path.read_text())
    assert got["step"] == [{"method": "b"}] and got["rows"] == first["rows"] and got["commit"] == "abc1234"
    assert got["carried"] == {"rows": {"commit": first["commit"], "date": first["date"], "command": first["command"]}}
    third = _doc(harness, rows=[], step=[{"method": "c"}], not_measured=["rows"], commit="def5678")
    harness.install_result(third, tmp_path)                  # carried again: still the run that measured it
    assert json.loads(path.read_text())["carried"]["rows"]["commit"] == first["commit"]
    # a section the old file has but empty is not carried (nothing measured it)
    harness.install_result(_doc(harness, rows=[], step=[], not_measured=[]), tmp_path)
    harness.install_result(_doc(harness, rows=[{"variant": "x"}], step=[], not_measured=["step"]), tmp_path)
    assert "carried" not in json.loads(path.read_text())
    with pytest.raises(ValueError, match="--quick run"):
        harness.install_result(_doc(harness, settings={"quick": True}), tmp_path)
    out = harness.write_result(_doc(harness), save=False, out=tmp_path / "out")
    assert out == tmp_path / "out" / "append-h100.json" and json.loads(out.read_text())["benchmark"] == "append"


def test_load_results_refuses_a_misnamed_file(harness, tmp_path):
    (tmp_path / "append-h200.json").write_text(json.dumps(_doc(harness)))
    with pytest.raises(ValueError, match="its name must be append-h100.json"):
        harness.load_results(tmp_path)


def test_current_results_carry_device_commit_date_command(harness):
    docs = harness.load_results()
    assert 1 <= len(docs) <= 15
    for d in docs:
        assert d["device"] and d["commit"] and d["date"] and d["command"].startswith("python scripts/bench/bench_")
        assert d["command"].split()[1] == f"scripts/bench/bench_{d['benchmark']}.py"
        assert not d["settings"].get("quick")
        for key, c in d.get("carried", {}).items():
            assert d.get(key) and c["commit"] and c["date"] and c["command"]


def test_benchmarks_page_is_the_rendering_of_the_results(tmp_path):
    report = load_script("bench/report.py")
    page = REPO / "docs" / "benchmarks.md"
    assert page.read_text() == report.render(), "run: python scripts/bench/report.py"
    assert report.main(["--check"]) == 0
    stale = tmp_path / "b.md"
    stale.write_text(page.read_text().replace("speed-up", "speedup", 1))
    assert report.main(["--check", "--page", str(stale)]) == 1
    text = page.read_text()
    assert "transformers' stock path" in text and "round" not in text.lower().replace("rounds", "")


def test_the_page_shows_figures_drawn_from_the_results(tmp_path):
    # each figure is on the page and in docs/img/bench as rendered from the results; a changed or an
    # orphaned figure fails --check; a rendering into an empty folder writes each one
    report = load_script("bench/report.py")
    figs = report.figures()
    text = (REPO / "docs" / "benchmarks.md").read_text()
    assert {"kernels-h200-time.svg", "kernels-h200-bandwidth.svg", "generate-h100-step.svg"} <= set(figs)
    for name, svg in figs.items():
        assert f"(img/bench/{name})" in text and (report.FIGURES / name).read_text() == svg
    folder = tmp_path / "img"
    assert report.main(["--page", str(tmp_path / "b.md"), "--figures", str(folder)]) == 0
    assert sorted(p.name for p in folder.iterdir()) == sorted(figs)
    assert report.main(["--check", "--page", str(tmp_path / "b.md"), "--figures", str(folder)]) == 0
    (folder / "kernels-h200-time.svg").write_text(figs["kernels-h200-time.svg"].replace("#1f5fa8", "#000000"))
    assert report.main(["--check", "--page", str(tmp_path / "b.md"), "--figures", str(folder)]) == 1
    (folder / "kernels-h200-time.svg").write_text(figs["kernels-h200-time.svg"])
    (folder / "old-h100-time.svg").write_text("<svg/>")
    assert report.main(["--check", "--page", str(tmp_path / "b.md"), "--figures", str(folder)]) == 1
    assert report.main(["--page", str(tmp_path / "b.md"), "--figures", str(folder)]) == 0
    assert not (folder / "old-h100-time.svg").exists()


def test_decode_figure_draws_each_series_at_its_values():
    # a point's height follows its value (SVG y grows downwards), one polyline per series and panel,
    # contexts on a log scale (each doubling the same width)
    import re

    plots = load_script("bench/plots.py")
    rows = [{"context": c, "batch": b, "int2_ms": i, "sdpa_ms": s, "int2_stream_ms": i * 0.9, "sdpa_stream_ms": s,
             "int2_bytes": 1e6 * c, "bf16_bytes": 7e6 * c}
            for b, k in ((1, 1.0), (32, 20.0)) for c, i, s in ((8192, 0.01 * k, 0.02 * k), (32768, 0.02 * k, 0.05 * k),
                                                                 (65536, 0.03 * k, 0.09 * k))]
    doc = {"device_name": "GPU", "copy": {"bytes_per_s": 4e12}, "rows": rows}
    svg = plots.decode_time(doc)
    lines = re.findall(r'<polyline[^>]*points="([^"]+)"', svg)
    assert len(lines) == 8                                       # 4 series x 2 panels
    int2, sdpa = ([tuple(map(float, p.split(","))) for p in lines[i].split()] for i in (0, 1))
    assert [x for x, _ in int2] == [x for x, _ in sdpa]
    (x0, _), (x1, _), (x2, _) = int2
    assert abs((x2 - x1) - (x1 - x0) / 2) < 0.2                  # 32K->64K is half of 8K->32K
    assert all(ys < yi for (_, yi), (_, ys) in zip(int2, sdpa))          # SDPA slower: drawn higher
    assert int2[0][1] > int2[1][1] > int2[2][1]
    assert plots.nice_ticks(138.3)[-1] >= 138.3 and plots.nice_ticks(0.5) == [0, 0.1, 0.2, 0.3, 0.4, 0.5]
    bw = plots.decode_bandwidth(doc)
    assert bw.count("<polyline") == 6 and "4.00 TB/s" in bw


def test_run_lists_and_refuses_unknown_names(capsys):
    run = load_script("bench/run.py")
    assert run.main(["list"]) == 0
    assert "kernels    scripts/bench/bench_kernels.py  current: h100" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no benchmark 'nope'"):
        run.main(["nope"])
    with pytest.raises(SystemExit, match="accept needs one or more result files"):
        run.main(["accept"])


def test_the_fair_table_names_flashinfer_s_form_or_why_it_is_absent():
    report = load_script("bench/report.py")
    row = {"batch": 1, "tokens": 131072, "bf16_roofline_ms": 8.0, "int2_roofline_ms": 4.0}
    for tag in ("", "compiled_"):
        row.update({f"{tag}bf16_sdpa_replay_ms": 10.0, f"{tag}bf16_flash_loop_ms": 11.0, f"{tag}bf16_ms": 10.0,
                    f"{tag}int2_loop_ms": 7.0, f"{tag}speedup": 10 / 7, f"{tag}bf16_roofline_pct": 80.0,
                    f"{tag}int2_roofline_pct": 57.0})
    timed = dict(row, bf16_flashinfer_replay_ms=10.5, flashinfer_form="tensor_cores")
    text = "\n".join(report._fair({"fair": [timed], "copy_bandwidth": 4.2e12,
                                   "flashinfer": {"version": "0.7.4", "forms": ["tensor_cores"]}}))
    assert "| 10.50 (tensor cores) |" in text and "FlashInfer 0.7.4:" in text
    text = "\n".join(report._fair({"fair": [row], "copy_bandwidth": 4.2e12,
                                   "flashinfer": {"skipped": "FlashInfer not importable here (ImportError: x)"}}))
    assert "FlashInfer not timed: FlashInfer not importable here (ImportError: x)." in text
    assert "FlashInfer was not timed in this run." in "\n".join(report._fair({"fair": [row], "copy_bandwidth": 4.2e12}))


def test_the_step_profile_gives_each_launch_its_share_of_the_gaps():
    report = load_script("bench/report.py")
    prof = {"batch": 1, "tokens": 131072,
            "int2": {"by_category_ms": {"GEMV": 4.0, "INT2 decode": 2.0}, "kernels_ms": 6.0, "launches": 400},
            "bf16": {"by_category_ms": {"GEMV": 4.0}, "kernels_ms": 4.0}}
    fair = {"batch": 1, "tokens": 131072, "compiled_int2_loop_ms": 7.0, "compiled_bf16_sdpa_replay_ms": 5.0}
    rows = [line for line in report._profile({"profile": [prof], "fair": [fair]}) if line.startswith("| 1 × 128K")]
    assert rows[0].endswith("| 6.00 | 400 | 2.50 |")         # (7.0 - 6.0) ms over 400 launches
    assert rows[1].endswith("| 4.00 | – | – |")              # a profile without its count says nothing
    alone = [line for line in report._profile({"profile": [prof]}) if line.startswith("| 1 × 128K")]
    assert alone[0].endswith("| 6.00 | 400 | – |")            # no fair row at that shape: no gap
    for side in ("int2", "bf16"):
        prof[side].pop("launches", None)
    old = report._profile({"profile": [prof], "fair": [fair]})
    assert "launches" not in old[2] and old[4].endswith("| 6.00 |")       # no count anywhere: no columns
