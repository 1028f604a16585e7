"""scripts/bench/bench_scale.py, dry-run on the CPU in this process (a tiny geometry; the dp mode's two
gloo ranks are processes of their own): both modes run the whole pipeline, write their result, and
the spread model is verified. On a GPU machine the same script measures a Qwen3-32B-shaped model
over several GPUs (docs/benchmarks.md)."""

import json

import pytest
from helpers import load_script

pytestmark = [pytest.mark.script, pytest.mark.slow]


def test_dry_run_on_the_cpu(tmp_path, capsys):
    load_script("bench/bench_scale.py").main(["--small", "--device", "cpu", "--tokens", "512", "--seq-len", "128",
                                              "--repeats", "1", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "scale-cpu.json").read_text())
    assert doc["benchmark"] == "scale" and doc["device"] == "cpu" and doc["settings"]["tokens"] == 512
    assert [r["mode"] for r in doc["rows"]] == ["spread", "dp"]
    for r in doc["rows"]:
        assert r["tokens"] == 512 and set(r["median_s"]) == {"plain", "capture", "end_to_end"}
        assert all(v > 0 for v in r["median_s"].values())
    assert doc["rows"][1]["world_size"] == 2
    verify = doc["rows"][0]["verify"]
    assert verify["seconds"] > 0 and isinstance(verify["passed"], bool) and verify["summary"]["mean_attn_error"] > 0
    out = capsys.readouterr()
    assert "round 1: end_to_end" in out.err and "verify on the spread model" in out.out
