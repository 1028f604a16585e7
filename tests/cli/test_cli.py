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
        d = tmp_path / "rwkv"           # a recurrent model: no KV cache to calibrate, refused before any weight
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "rwkv"}))
        model, pattern = str(d), "unsupported architecture 'rwkv': recurrent model without a KV cache"
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
    from oscar_calib.contract.artifact import read_metadata

    assert read_metadata(out)["granularity"] == "layer"
    cfg.write_text("calibration:\n  tokenz: 5\n")
    code, _, err = oscar("calibrate", str(tiny_llama_dir), "--config", str(cfg),
                         "--out", str(tmp_path / "o2"))
    assert_one_line_error(code, err, "unknown key(s) tokenz")


def test_key_centering_from_the_command_line_and_the_config(tmp_path, tiny_llama_dir):
    from oscar_calib.contract.artifact import read_metadata

    code, _, err = oscar("calibrate", str(tiny_llama_dir), "--out", str(tmp_path / "c"), *FAST_ARGS, "--center-keys")
    assert code == 0, err
    assert read_metadata(tmp_path / "c")["k_centered"] == "true"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("calibration:\n  center_keys: true\n")
    code, _, err = oscar("calibrate", str(tiny_llama_dir), "--config", str(cfg), "--out", str(tmp_path / "r"),
                         *FAST_ARGS, "--raw-keys")
    assert code == 0, err
    assert "k_centered" not in read_metadata(tmp_path / "r")
    cfg.write_text("calibration:\n  center_keys: sometimes\n")
    code, _, err = oscar("calibrate", str(tiny_llama_dir), "--config", str(cfg), "--out", str(tmp_path / "b"))
    assert_one_line_error(code, err, "center_keys must be true or false, got 'sometimes'")
    assert not (tmp_path / "b").exists()
    code, _, err = oscar("calibrate", str(tiny_llama_dir), "--out", str(tmp_path / "f"), *FAST_ARGS, "--center-keys",
                         "--center-fit", "raw")
    assert code == 0, err
    assert read_metadata(tmp_path / "f")["k_center_fit"] == "raw"
    cfg.write_text("calibration:\n  center_keys: true\n  center_fit: raw\n  center_seq_len: 128\n")
    code, _, err = oscar("calibrate", str(tiny_llama_dir), "--config", str(cfg), "--out", str(tmp_path / "p"),
                         *FAST_ARGS, "--raw-keys")          # a centering recipe run uncentered: named, not refused
    assert code == 0, err
    assert "--center-fit raw and --center-seq-len 128 ignored: the keys are not centered (--center-keys)" in err
    assert "k_centered" not in read_metadata(tmp_path / "p")
    code, _, err = oscar("calibrate", str(tiny_llama_dir), "--out", str(tmp_path / "b"), "--center-keys",
                         "--center-fit", "mean")
    assert_one_line_error(code, err, "unknown --center-fit 'mean'; choose from centered, raw")
    code, _, err = oscar("calibrate", str(tiny_llama_dir), "--out", str(tmp_path / "b"), "--center-keys",
                         "--center-seq-len", "128")
    assert_one_line_error(code, err, "--center-seq-len takes the mean key over other windows than the fit's: it "
                          "needs --center-fit raw")
    assert not (tmp_path / "b").exists()


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


@pytest.mark.parametrize("data", ["corpus.tx", "./corpus.txt", "texts/corpus.jsonl"])
def test_a_missing_data_file_is_one_line_before_any_model_or_hub(monkeypatch, capsys, tmp_path, data):
    """A --data value that looks like a path and is not there: "no such file", and neither the
    tokenizer, the model nor the datasets hub was asked for anything."""
    import datasets

    import oscar_calib.calibration.pipeline as pipeline

    asked = []
    monkeypatch.chdir(tmp_path)
    (tmp_path / "texts").mkdir()
    monkeypatch.setattr(pipeline, "load_tokenizer", lambda *a, **k: asked.append("tokenizer"))
    monkeypatch.setattr(pipeline, "prepare_model", lambda *a, **k: asked.append("model"))
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: asked.append("hub"))
    code, _, err = oscar("calibrate", "--data", data, "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, f"no such file: {data} (--data takes embedded, embedded-code, ")
    assert asked == [] and not (tmp_path / "o").exists()


def test_too_little_data_is_found_before_the_weights_load(monkeypatch, capsys, tmp_path, tiny_dir):
    """Counting tokens needs the tokenizer only: the weights are never read for a short file."""
    import oscar_calib.calibration.pipeline as pipeline

    (tmp_path / "short.txt").write_text("only a few words here")
    monkeypatch.setattr(pipeline, "prepare_model", lambda *a, **k: pytest.fail("the model was loaded"))
    code, _, err = oscar("calibrate", str(tiny_dir), "--data", str(tmp_path / "short.txt"),
                            "--out", str(tmp_path / "o"), *FAST_ARGS)
    assert_one_line_error(code, err, "need")
    assert not (tmp_path / "o").exists()


def test_hub_ids_are_not_mistaken_for_paths():
    from oscar_calib.data.corpus import looks_like_path

    assert not any(map(looks_like_path, ["wikitext", "Salesforce/wikitext", "bigcode/the-stack-v1.2"]))
    assert all(map(looks_like_path, ["corpus.tx", "./c", "~/c", "/data/c", "a/b/c", "a\\b"]))


@pytest.mark.parametrize("group", ["2", "3", "48"])
def test_a_bad_group_size_is_refused_before_the_model_loads(tmp_path, group):
    """The group-size rule (a power of two of at least 4) is checked with the options, before any model
    is resolved: the model named here does not exist, and the error is about the group size."""
    code, _, err = oscar("calibrate", str(tmp_path / "no-such-model"), "--out", str(tmp_path / "out"),
                         "--group-size", group)
    assert_one_line_error(code, err, f"--group-size {group} is ")
    assert not (tmp_path / "out").exists()
