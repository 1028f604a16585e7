"""scripts/bench/bench_generate.py --quick, in this process: every section runs on the CPU with a tiny
model (a short BF16 window, so the contexts reach the INT2 history) and writes its result."""

import json

import pytest
import torch
from factories import load_script, script_error

pytestmark = pytest.mark.script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench/bench_generate.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="--quick is the CPU smoke run; a GPU runs the benchmark")
def test_quick_runs_every_section(bench, tmp_path, capsys):
    data = bench.main(["--quick", "--compile", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "generate-cpu.json").read_text()) == json.loads(json.dumps(data, default=str))
    assert data["benchmark"] == "generate" and data["errors"] == [] and data["settings"]["recent"] == 16
    assert {(r["batch"], r["tokens"], r["cache"]) for r in data["rows"]} >= {(1, 96, "dynamic"), (1, 96, "oscar"),
                                                                          (2, 64, "oscar")}
    assert all(r["tok_s"] > 0 for r in data["rows"])
    assert data["graph"] == []                      # CUDA graphs: on a GPU only
    methods = [r["method"] for r in data["generate"]]
    assert methods == ["dynamic", "oscar", "oscar+graph", "oscar+graph+eos", "oscar+graph+compile"]
    assert all("generate_tok_s" in r and r["decode_wall_s"] > 0 for r in data["generate"])
    assert [r["cache"] for r in data["ttft"]] == ["dynamic", "oscar"]
    out = capsys.readouterr().out
    assert "| prompt | DynamicCache (stock) | OscarCache eager | `graph_decoding` |" in out
    assert "| 1 × 96 | OscarCache |" in out


@pytest.mark.parametrize("bad, why", [(["--sections", "decode,nope"], "--sections takes fair, profile, capacity, decode, graph"),
                                      (["--save"], "--save accepts a GPU run only")])
def test_bad_input_is_one_line(bench, tmp_path, bad, why):
    assert why in script_error(bench.main, ["--quick", "--out", str(tmp_path / "out"), *bad])
    assert not (tmp_path / "out").exists()
