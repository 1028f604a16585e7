"""Big models end to end on the CPU: ``oscar verify`` and ``oscar eval`` on a random-init model
spread with a device map (accelerate: ~1.5 decoder layers in "CPU memory", the rest offloaded to
disk and read from the checkpoint's safetensors), against the same model loaded whole. The GPU
part (a Qwen3-32B-shaped model spread, as ranks and as ranks each spread over GPUs) is
``scripts/bench/bench_scale.py``."""

import json

import pytest
from factories import oscar

from oscar_calib.eval import EvalOptions, run_eval
from oscar_calib.eval.verify import verify_artifact
from oscar_calib.model.load import load_model
from oscar_calib.model.placement import Placement

SPREAD = Placement("auto", {"cpu": 200_000})
# depths past the 64 + 256 BF16 tokens, so the INT2 history is exercised (the model has 512 positions)
VERIFY = dict(depths=(384, 448), sequences=1, positions=2, backend="torch", write=False)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(abs(b), 1e-12)


def test_the_spread_model_is_really_spread(tiny_dir):
    lm = load_model(str(tiny_dir), device="cpu", placement=SPREAD)
    where = set(lm.model.hf_device_map.values())
    assert where == {"cpu", "disk"}, lm.model.hf_device_map


def test_verify_on_a_spread_model_equals_the_whole_model(tmp_path, tiny_dir, plain_artifact):
    whole = verify_artifact(plain_artifact, model=str(tiny_dir), device="cpu", **VERIFY)
    assert whole.settings["spread"] is False
    code, out, err = oscar("verify", str(plain_artifact), "--model", str(tiny_dir),
                           "--depths", "384,448", "--sequences", "1", "--positions", "2", "--backend", "torch",
                           "--device", "cpu", "--device-map", "auto", "--max-memory", "cpu=200000", "--json")
    assert code in (0, 1), err                      # pass or fail is the artifact's business; it ran
    spread = json.loads(out)
    assert spread["settings"]["spread"] is True
    for a, b in zip(spread["layers"], whole.layers):
        for method in ("artifact", "hadamard"):
            assert close(a[method]["attn"], b[method]["attn"]) and close(a[method]["logit"], b[method]["logit"])
        assert a["artifact"]["samples"] == b["artifact"]["samples"] > 0
    assert spread["passed"] == whole.passed


@pytest.mark.parametrize("task", ["ppl", "niah"])
def test_eval_on_a_spread_model_equals_the_whole_model(tmp_path, tiny_dir, plain_artifact, task):
    if task == "ppl":
        opts = EvalOptions(task="ppl", methods="bf16,hadamard,oscar", sequences=1, seq_len=448, sink=16, recent=32)
    else:                                           # through OscarCache and model.generate
        opts = EvalOptions(task="niah", methods="bf16,oscar", lengths="480", depths="0.5", sink=16, recent=32)
    whole = run_eval(str(tiny_dir), plain_artifact, opts, device="cpu")
    spread = run_eval(str(tiny_dir), plain_artifact, opts, device="cpu", placement=SPREAD)
    assert len(spread.rows) == len(whole.rows) == (3 if task == "ppl" else 2)
    for a, b in zip(spread.rows, whole.rows):
        if task == "ppl":
            assert a["method"] == b["method"] and close(a["ppl"], b["ppl"]), (a, b)
        else:
            assert a == b


def test_eval_cli_takes_the_placement_options(tmp_path, tiny_dir, plain_artifact):
    code, out, err = oscar("eval", str(tiny_dir), str(plain_artifact), "--methods", "bf16,oscar",
                           "--sequences", "1", "--seq-len", "128", "--sink", "16", "--recent", "32", "--device",
                           "cpu", "--device-map", "auto", "--max-memory", "cpu=200000", "--plot",
                           str(tmp_path / "p.png"), "--json")
    assert code == 0, err
    assert [r["method"] for r in json.loads(out)["rows"]] == ["bf16", "oscar"]
    code, _, err = oscar("eval", str(tiny_dir), str(plain_artifact), "--max-memory", "cpu=1GiB")
    assert code == 2 and err.strip().endswith("--max-memory needs --device-map (e.g. --device-map auto)"), err
