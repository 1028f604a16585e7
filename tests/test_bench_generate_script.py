"""scripts/bench/bench_generate.py --quick: every section runs on the CPU with a tiny model and writes its JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "bench_generate.py"


def test_bench_generate_quick_runs_every_section(tmp_path):
    out = tmp_path / "g.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--compile", "--out", str(out)], capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["errors"] == []
    assert {(r["batch"], r["tokens"], r["cache"]) for r in data["runs"]} >= {(1, 400, "dynamic"), (1, 400, "oscar"),
                                                                          (2, 600, "oscar")}
    assert all(r["tok_s"] > 0 for r in data["runs"])
    methods = [r["method"] for r in data["generate"]]
    assert methods == ["dynamic", "oscar", "oscar+graph", "oscar+graph+eos", "oscar+graph+compile"]
    assert all("generate_tok_s" in r and r["decode_wall_s"] > 0 for r in data["generate"])
    assert [r["cache"] for r in data["ttft"]] == ["dynamic", "oscar"] * 2
    assert "| generate() 1 × 400 | oscar+graph |" in res.stdout
