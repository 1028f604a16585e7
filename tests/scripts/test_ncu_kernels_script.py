"""scripts/dev/ncu_kernels.py merge, in this process: Nsight Compute's raw CSV into per-kernel metrics
and a bound."""

import csv
import io
import json

import pytest
from factories import load_script

pytestmark = pytest.mark.script


def _csv(rows: list[dict]) -> str:
    keys = list(rows[0])
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys, quoting=csv.QUOTE_ALL)
    w.writeheader()
    w.writerow({k: ("usecond" if k == "gpu__time_duration.sum" else "") for k in keys})  # the units row
    for r in rows:
        w.writerow(r)
    return "==PROF== Connected to process 1\n" + buf.getvalue()


def _row(i, name, dram, issue, alu, wait, barrier):
    return {"ID": str(i), "Kernel Name": name, "gpu__time_duration.sum": "390.5",
            "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": str(dram),
            "smsp__issue_active.avg.pct_of_peak_sustained_active": str(issue),
            "smsp__inst_executed.sum": "148,463,600",
            "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_elapsed": str(alu),
            "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_elapsed": "4.84",
            "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed": "17.84",
            "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio": str(wait),
            "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": str(barrier)}


def test_merge_adds_metrics_pipes_and_bounds(tmp_path, capsys):
    rows = [_row(0, "quantize_kv_planes_kernel", 23.5, 41.0, 56.39, 1.1, 0.7),
            _row(1, "decode_kernel", 81.0, 30.0, 20.0, 0.2, 0.1),
            _row(2, "quantize_kv_planes_kernel", 20.0, 75.0, 80.0, 0.3, 0.2)]
    (tmp_path / "ncu.csv").write_text(_csv(rows))
    labels = [{"kernel": "quantize_kv_planes_kernel", "what": "write a", "config": {}, "bytes": 302_000_000},
              {"kernel": "decode_kernel", "what": "decode", "config": {}, "bytes": None},
              {"kernel": "quantize_kv_planes_kernel", "what": "write b", "config": {"x": 1}, "bytes": None}]
    (tmp_path / "labels.json").write_text(json.dumps(labels))
    (tmp_path / "rep.json").write_text(json.dumps({"shape": {}}))
    load_script("dev/ncu_kernels.py").main(["merge", "--report", str(tmp_path / "rep.json"),
                                            "--labels", str(tmp_path / "labels.json"), "--csv", str(tmp_path / "ncu.csv")])
    got = json.loads((tmp_path / "rep.json").read_text())["ncu"]
    assert [g["what"] for g in got] == ["write a", "decode", "write b"]
    a, dec, b = (g["metrics"] for g in got)
    assert a["time"] == 390500.0  # microseconds in the units row, nanoseconds in the report
    assert a["warp_instructions"] == 148463600
    assert (a["alu_pipe_pct"], a["fma_pipe_pct"], a["tensor_pipe_pct"]) == (56.39, 4.84, 17.84)
    assert a["bound"] == "latency (wait)" and dec["bound"] == "memory" and b["bound"] == "instruction issue"
    assert abs(a["achieved_GBps_at_ncu_clock"] - 302e6 / 390.5e-6 / 1e9) < 1e-6
    assert "pipes ALU 56% FMA 5% tensor 18%" in capsys.readouterr().out
