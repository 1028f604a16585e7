"""scripts/bench/bench_scale.py: its helpers in-process, and a dry run of every scenario on the
CPU (tiny geometries, gloo): the three layouts, two torchrun "nodes" with a rank killed and resumed,
and data-parallel scaling, each writing its rows into one JSON. On the GPU machine the same script
measures the Qwen3-32B- and 8B-shaped models (docs/guides/scaling.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from factories import load_script
from safetensors.torch import save_file

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "bench_scale.py"

pytestmark = pytest.mark.script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench/bench_scale.py")


def test_gpus_used_and_scenario_limits(bench):
    """The device slug counts the GPUs the chosen scenarios use, not the ones visible."""
    def used(*argv, visible=4):
        return bench.gpus_used(bench.parse_args(list(argv)), visible)

    assert used() == 4                                                   # the spread layout: every GPU
    assert used("--mode", "layouts", "--layouts", "ranks", "--ranks", "2") == 2
    assert used("--mode", "dp-scaling", "--scale-ranks", "1,2") == 2
    assert used("--mode", "torchrun,dp-scaling", "--scale-ranks", "1,4") == 4
    assert used("--mode", "torchrun", "--node-ranks", "1") == 2
    assert used("--mode", "dp-scaling", "--scale-ranks", "1,8", visible=4) == 4
    assert used("--mode", "layouts", "--ranks", "3", visible=8) == 8
    assert used("--mode", "layouts", "--layouts", "ranks-x-spread", "--ranks", "3", visible=8) == 6
    assert bench.scenario_timeout("600", "torchrun") == 600
    assert bench.scenario_timeout("layouts=300,torchrun=150", "torchrun") == 150
    assert bench.scenario_timeout("layouts=300", "dp-scaling") == 900


@pytest.mark.parametrize("argv", [["--small", "--device", "cpu", "--save"], ["--device", "cpu", "--save"],
                                  ["--small", "--save"], ["--mode", "layouts,nope"]])
def test_a_dry_run_is_never_saved_and_unknown_scenarios_are_refused(bench, argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    msg = str(e.value)
    assert msg.startswith("error: ") and "\n" not in msg
    assert ("never a current result" in msg) if "--save" in argv else ("--mode nope" in msg)


def test_the_same_weights_in_every_layout(bench):
    """Each parameter's values depend on its name alone, not on which part of a device map (or which
    device) materialises it: the layouts calibrate one model."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(**bench.SMALL, tie_word_embeddings=False)
    whole, parts = (AutoModelForCausalLM.from_config(cfg) for _ in range(2))
    bench.init_weights(whole)
    for name in ("model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"):
        bench.init_weights(parts.get_submodule(name), name)
    a, b = dict(whole.named_parameters()), dict(parts.named_parameters())
    for name in ("model.layers.1.self_attn.q_proj.weight", "lm_head.weight", "model.layers.0.input_layernorm.weight"):
        assert torch.equal(a[name], b[name]), name
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], a["model.layers.1.self_attn.q_proj.weight"])


def test_compare_says_bit_for_bit_or_how_far(bench, tmp_path):
    def row(name, rot, acc):
        art, accp = tmp_path / f"{name}.safetensors", tmp_path / f"{name}.acc.pt"
        save_file({"layers.0.k_rotation": rot}, str(art), metadata={"format": "oscar-rotations"})
        torch.save({"0.q": acc, "0.tokens": torch.tensor(7)}, accp)
        import hashlib

        return {"name": name, "artifact": str(art), "accumulators": str(accp),
                "artifact_sha256": hashlib.sha256(art.read_bytes()).hexdigest()}

    rot, acc = torch.eye(4), torch.rand(2, 4, 4, dtype=torch.float64) + 1
    ref, same = row("ref", rot, acc), row("same", rot.clone(), acc.clone())
    got = bench.compare(same, ref)
    assert got["artifact_bytes_equal"] and got["accumulators_bit_equal"] and got["tokens_equal"]
    assert got["accumulators_max_rel_diff"] == 0.0
    moved = rot.clone()
    moved[0, 1] = 2**-20
    bumped = acc.clone()
    bumped[0, 0, 0] *= 1 + 2**-40
    got = bench.compare(row("off", moved, bumped), ref)
    assert not got["artifact_bytes_equal"] and not got["accumulators_bit_equal"]
    assert got["tensors_differing"] == 1 and got["max_abs_diff"] == 2**-20 and got["metadata_differing"] == []
    assert 0 < got["accumulators_max_rel_diff"] < 1e-11


def dry_run(tmp_path: Path, *args: str) -> tuple[dict, str, str]:
    """The script on the CPU (tiny geometries, gloo, one thread a process): its rows by scenario and
    name, its stdout, and its section of the benchmarks page (a single run: no run column)."""
    env = dict(os.environ, OUT=str(tmp_path), OMP_NUM_THREADS="1", PYTHONPATH=str(SCRIPT.parents[2]))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--small", "--device", "cpu", "--threads", "1", *args],
                          capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = load_script("bench/harness.py").check_result(json.loads((tmp_path / "scale-cpu.json").read_text()))
    assert doc["benchmark"] == "scale" and doc["device"] == "cpu" and doc["settings"]["quick"]
    assert doc["command"].startswith("python scripts/bench/bench_scale.py --small --device cpu")
    assert "accelerate" in doc["versions"] and doc["device_facts"]["slug"] == "cpu"
    assert not [r for r in doc["rows"] if "error" in r], [r["error"] for r in doc["rows"] if "error" in r]
    page = "\n".join(load_script("bench/report.py").scale(doc))
    assert "run (commit)" not in page and "Not finished" not in page
    return {(r["scenario"], r.get("name")): r for r in doc["rows"]}, proc.stdout, page


@pytest.mark.slow
def test_dry_run_layouts_and_scaling(tmp_path):
    rows, stdout, page = dry_run(tmp_path, "--mode", "layouts,dp-scaling", "--tokens", "1024", "--seq-len", "256",
                           "--heldout-tokens", "64", "--scale-ranks", "1,2", "--scale-tokens", "1024")
    # the layouts: the same model three ways; the artifacts and accumulators are the first's, bit for bit
    for name, ranks in (("spread", 1), ("ranks-x-spread", 2), ("ranks", 2)):
        r = rows[("layouts", name)]
        assert r["ranks"] == ranks and set(r["median_s"]) == {"plain", "capture", "end_to_end"}
        assert all(v > 0 for v in r["median_s"].values())
        assert r["calibrate_timings"]["fitted_layers"] == 4 // ranks           # the fitting is split by layer
        if name != "spread":
            eq = r["equal_to_reference"]
            assert eq["against"] == "spread" and eq["artifact_bytes_equal"] and eq["accumulators_bit_equal"]
    verify = rows[("layouts", "ranks-x-spread")]["verify"]
    assert verify["seconds"] > 0 and isinstance(verify["passed"], bool) and verify["summary"]["mean_attn_error"] > 0
    # scaling: 1 and 2 ranks, the same accumulators and artifact
    two = rows[("dp-scaling", "2 rank(s)")]
    assert two["equal_to_reference"]["artifact_bytes_equal"] and two["equal_to_reference"]["accumulators_bit_equal"]
    assert set(two["speedup"]) == {"plain", "capture", "end_to_end"}
    assert "verify: " in stdout and "dp-scaling" in stdout
    for cells in ("| spread over 2 GPUs, 1 process |", "| 2 ranks × 1 GPU |", "| 2 ranks, whole model each |",
                  "| (baseline) | (reference) |", "| artifact byte-identical, accumulators bit-equal |"):
        assert cells in page, cells
    assert page.count("artifact byte-identical, accumulators bit-equal") == 3
    assert f"{verify['seconds']:.1f} s, {'passed' if verify['passed'] else 'failed'}" in page   # the row's own verdict


@pytest.mark.slow
def test_dry_run_torchrun_nodes(tmp_path):
    """The script's torchrun scenario (the CLI's own behaviour is tests/jobs/test_multinode.py's)."""
    rows, stdout, page = dry_run(tmp_path, "--mode", "torchrun", "--node-ranks", "1", "--node-tokens", "1024",
                           "--node-seq-len", "128", "--die-at", "2", "--slow-s", "4", "--heartbeat", "2")
    # two torchrun "nodes": the artifact of one process; a rank killed, the other stopped with one line; resumed
    t = rows[("torchrun", "2 nodes x 1")]
    assert t["clean"]["artifact_bytes_equal_one_process"] and t["resume"]["artifact_bytes_equal_one_process"]
    f = t["fault"]
    assert f["victim_rank"] == 1 and not f["artifact_written"] and len(f["checkpoints_kept"]) == 2
    lines = f["error_lines_by_rank"]["0"]
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: stopped: rank 1") and "--resume" in lines[0]
    assert f["survivors_stopped_within_s"] is not None and t["resume"]["checkpoints_left"] == []
    assert "torchrun" in stdout
    assert "| 2 × 1 | byte-identical (exit 0 / 0) | rank 1 after batch 2 of " in page
    assert "| 1 `error:` line (ranks 0), 0 tracebacks from oscar | byte-identical, 0 checkpoints left |" in page
