"""The CLI: one clear line and a non-zero exit for bad input, nothing left behind; --json."""

import json
import subprocess
import sys

import pytest
from factories import FAST_ARGS, assert_one_line_error, oscar


def test_calibrate_json_on_a_local_checkpoint(tmp_path, tiny_llama_dir):
    out = tmp_path / "art"
    code, stdout, err = oscar("calibrate", str(tiny_llama_dir), "--out", str(out),
                              *FAST_ARGS, "--json")
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["out"] == str(out) and len(doc["layers"]) == 2
    assert {"mean_attn_error_oscar", "mean_attn_error_hadamard"} <= set(doc["summary"])
    assert (out / "oscar.safetensors").exists()


@pytest.mark.parametrize("case", ["missing", "unsupported", "unknown_arch", "tokens0", "bad_clip", "bad_objective",
                                  "empty_data", "unwritable", "under_a_file", "bad_refine", "refine_layer"])
def test_bad_input_is_one_line(tmp_path, tiny_llama_dir, case):
    out = tmp_path / "out"
    model = str(tiny_llama_dir)
    extra = []
    if case == "missing":
        model, pattern = str(tmp_path / "nope"), "not found"
    elif case == "unsupported":
        d = tmp_path / "mla"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
        model, pattern = str(d), "multi-head latent attention"
    elif case == "unknown_arch":
        d = tmp_path / "gpt2"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
        model, pattern = str(d), "unsupported architecture 'gpt2'"
    elif case == "tokens0":
        extra, pattern = ["--tokens", "0"], "--tokens must be positive"
    elif case == "bad_clip":
        extra, pattern = ["--clip", "k=1.5,v=0.9"], "outside (0, 1]"
    elif case == "bad_objective":
        extra, pattern = ["--k-objective", "qk"], "unknown --k-objective"
    elif case == "bad_refine":
        extra, pattern = ["--refine-steps", "-3"], "--refine-steps must be >= 0"
    elif case == "refine_layer":
        extra, pattern = ["--refine-steps", "4", "--granularity", "layer"], "needs --granularity head"
    elif case == "empty_data":
        (tmp_path / "empty.txt").write_text("   \n")
        extra, pattern = ["--data", str(tmp_path / "empty.txt")], "no text"
    elif case == "unwritable":
        out, pattern = "/proc/oscar-cannot-write-here", "not writable"
    else:
        (tmp_path / "file").write_text("x")
        out, pattern = tmp_path / "file" / "out", "not a directory"
    args = ["calibrate", model, "--out", str(out), *FAST_ARGS]
    code, _, err = oscar(*args, *extra)
    assert_one_line_error(code, err, pattern)
    if not str(out).startswith("/proc"):
        assert not (tmp_path / "out").exists()


def test_existing_artifact_refused_then_overwritten(tmp_path, tiny_llama_dir):
    out = tmp_path / "art"
    args = ["calibrate", str(tiny_llama_dir), "--out", str(out), *FAST_ARGS]
    assert oscar(*args)[0] == 0
    before = (out / "oscar.safetensors").read_bytes()
    code, _, err = oscar(*args, "--seed", "4")
    assert_one_line_error(code, err, "--overwrite")
    assert (out / "oscar.safetensors").read_bytes() == before
    assert oscar(*args, "--seed", "4", "--overwrite")[0] == 0
    assert (out / "oscar.safetensors").read_bytes() != before


def test_config_file_sets_defaults_and_rejects_unknown_keys(tmp_path, tiny_llama_dir):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("calibration:\n  granularity: layer\n  tokens: 256\n  seq_len: 64\n  heldout_tokens: 32\n")
    out = tmp_path / "art"
    code, stdout, err = oscar("calibrate", str(tiny_llama_dir), "--config", str(cfg),
                              "--out", str(out), "--no-verify", "--json")
    assert code == 0, err
    from oscar_calib.spec.artifact import read_metadata

    assert read_metadata(out)["granularity"] == "layer"
    cfg.write_text("calibration:\n  tokenz: 5\n")
    code, _, err = oscar("calibrate", str(tiny_llama_dir), "--config", str(cfg),
                         "--out", str(tmp_path / "o2"))
    assert_one_line_error(code, err, "unknown key(s) tokenz")


def test_console_script_maps_errors_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "oscar_calib", "calibrate", str(tmp_path / "missing-model"),
                           "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: model")
    assert "Traceback" not in proc.stderr


def test_help_documents_every_option():
    proc = oscar("calibrate", "--help", env={"COLUMNS": "200"})
    assert proc.exit_code == 0, proc.output
    for opt in ("--data", "--tokens", "--seq-len", "--batch-size", "--seed", "--out", "--k-objective",
                "--v-objective", "--composition", "--granularity", "--group-size", "--clip", "--resume",
                "--overwrite", "--json", "--dtype", "--device", "--trust-remote-code", "--split", "--text-field",
                "--refine-steps", "--refine-lr"):
        assert opt in proc.stdout, opt
