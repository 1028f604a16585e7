"""scripts/bench/bench_scale.py, dry-run on the CPU (a tiny geometry, two gloo ranks): both modes run
the whole pipeline, write their JSON and the spread model is verified. On the GPU machine the
same script measures the Qwen3-32B-shaped model over two GPUs (README, "Scaling")."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "bench_scale.py"


def test_dry_run_on_the_cpu(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--small", "--device", "cpu", "--tokens", "2048",
                           "--seq-len", "512", "--repeats", "1"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "bench_scale.json").read_text())
    assert [r["mode"] for r in doc["runs"]] == ["spread", "dp"]
    for r in doc["runs"]:
        assert r["tokens"] == 2048 and set(r["median_s"]) == {"plain", "capture", "end_to_end"}
        assert all(v > 0 for v in r["median_s"].values())
    assert doc["runs"][1]["world_size"] == 2
    verify = doc["runs"][0]["verify"]
    assert verify["seconds"] > 0 and isinstance(verify["passed"], bool) and verify["summary"]["mean_attn_error"] > 0
    assert "round 1: end_to_end" in proc.stderr and "verify on the spread model" in proc.stdout
