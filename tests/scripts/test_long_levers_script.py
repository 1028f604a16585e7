"""scripts/experiments/long_levers.py end to end on a tiny checkpoint, in this process: every variant at
two lengths, the JSON, the table; and scripts/experiments/save_tokenizer.py."""

import json

import pytest
import yaml
from factories import (
    byte_tokenizer,
    calibrate_tiny,
    load_script,
    loaded_tiny,
    save_checkpoint,
    script_error,
)

pytestmark = pytest.mark.script


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Gemma-3-like checkpoint (a sliding and a full layer) with a byte tokenizer, an artifact
    calibrated on it (sink 4 + recent 8, correction 0.5) and a recipe for long-cal."""
    root = tmp_path_factory.mktemp("levers")
    lm = loaded_tiny("gemma3", head_dim=32, vocab_size=260)         # the byte tokenizer's 257 ids
    ckpt = save_checkpoint(root / "ckpt", lm.model, byte_tokenizer())
    art = root / "art"
    calibrate_tiny(art, loaded=lm, sink_tokens=4, recent_tokens=8, logit_correction=0.5, group_size=16)
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"calibration": {"pilot_tokens": 64, "sink_tokens": 4, "recent_tokens": 8,
                                                      "group_size": 16, "logit_correction": 0.5}}))
    return ckpt, art, recipe


def test_every_lever_at_two_lengths(tiny, tmp_path, capsys):
    ckpt, art, recipe = tiny
    mod = load_script("experiments/long_levers.py")
    out = tmp_path / "levers.json"
    mod.main(["--model", f"tiny={ckpt}", "--tokenizer", f"tiny={ckpt}", "--artifact", f"tiny={art}",
              "--config", f"tiny={recipe}", "--lengths", "tiny=64,128", "--window", "8+24", "--gains", "0,1",
              "--cal-seq-len", "64", "--cal-heldout", "32", "--device", "cpu", "--out", str(out),
              "--real-cache", "zoo,channel"])
    doc = json.loads(out.read_text())
    rows = {(r["variant"], r["length"]): r for r in doc["rows"]}
    variants = ["bf16", "hadamard", "zoo", "gain=0", "gain=1", "window=8+24", "long-cal64", "channel", "channel-kivi"]
    assert set(rows) == {(v, n) for v in variants for n in (64, 128)}
    assert all(r["scored"] == r["tokens"] == r["length"] // 2 for r in doc["rows"])     # eval's rule: half the window
    zoo64, zoo128 = rows[("zoo", 64)], rows[("zoo", 128)]
    assert zoo64["logit_correction"] == 0.5 and rows[("gain=1", 64)]["logit_correction"] == 1.0
    assert zoo64["vs_bf16"] == pytest.approx(zoo64["ppl"] / rows[("bf16", 64)]["ppl"] - 1)
    assert zoo128["bits_at_context"] < zoo64["bits_at_context"] < rows[("window=8+24", 64)]["bits_at_context"]
    assert zoo128["int2_keys"] == pytest.approx(sum(i + 1 - 12 for i in range(63, 127)) / 64)
    assert rows[("channel", 64)]["bits_per_element"] == rows[("gain=0", 64)]["bits_per_element"]
    assert rows[("channel", 64)]["ppl"] != rows[("gain=0", 64)]["ppl"] != rows[("channel-kivi", 64)]["ppl"]
    assert doc["models"]["tiny"]["variants"]["long-cal64"]["seq_len"] == 64 and doc["device"] == "cpu"
    assert zoo64["ppl_real"] == pytest.approx(zoo64["ppl"], rel=1e-4)          # OscarCache scores what the simulation does
    assert "exists only in the perplexity simulation" in rows[("channel", 64)]["real_cache"]
    printed = capsys.readouterr().out
    assert out.with_suffix(".md").read_text() in printed
    svg = (tmp_path / "tiny-cpu.svg").read_text()           # the figure beside the JSON: a line per variant (one text)
    assert svg.count("<polyline") == len(mod.FIGURE_VARIANTS) and "window=8+24 (" in svg and "bits)" in svg
    assert "| zoo | 4.000 |" in printed and "best logit-correction gain: 64 (" in printed
    assert script_error(mod.main, ["--model", "tiny", "--variants", "zoo,int3"]) == (
        "error: unknown variant(s) int3; choose from bf16, hadamard, zoo, gain, window, long-cal, channel, channel-kivi, "
        "channel-clip")


def test_docs_figures_are_rendered_from_the_committed_results(tmp_path):
    """Every figure under docs/img/levers is what ``--render`` draws from its committed result; a model
    measured at one length gets none."""
    mod = load_script("experiments/long_levers.py")
    results = sorted((mod.ROOT / "scripts" / "experiments" / "results").glob("long_levers_*.json"))
    drawn = {}
    for path in results:
        doc = json.loads(path.read_text())
        for alias in dict.fromkeys(r["model"] for r in doc["rows"]):
            svg = mod.figure(doc, alias)
            lengths = {r["length"] for r in doc["rows"] if r["model"] == alias}
            assert (svg is None) == (len(lengths) < 2)
            if svg:
                drawn[mod.figure_name(doc, alias)] = svg
    assert drawn and {p.name: p.read_text() for p in mod.FIGURES.glob("*.svg")} == drawn


def test_save_tokenizer_writes_a_folder_once(tiny, tmp_path):
    from transformers import AutoTokenizer

    ckpt, _, _ = tiny
    mod = load_script("experiments/save_tokenizer.py")
    mod.main([str(ckpt), str(tmp_path / "tok")])
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert tok("abc")["input_ids"] == byte_tokenizer()("abc")["input_ids"]
    assert script_error(mod.main, [str(ckpt), str(tmp_path / "tok")]) == f"error: {tmp_path / 'tok'} exists; give a new folder"
