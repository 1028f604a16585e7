"""The corpus (oscar_calib.data.corpus): local files and hub data sets as texts, the embedded
corpora and their halves, the seeded token plan."""

import importlib.util
import json
from pathlib import Path

import pytest

from oscar_calib.data.corpus import (
    CODE_MODULES,
    EMBEDDED_CODE,
    embedded_code_texts,
    load_texts,
    plan_tokens,
)
from oscar_calib.errors import DataError


def test_data_sources(tmp_path, char_tokenizer):
    import pyarrow as pa  # a dependency of datasets
    import pyarrow.parquet as pq

    text = " ".join(f"w{i}" for i in range(2000))
    pq.write_table(pa.table({"content": [text[:3000], text[3000:]]}), tmp_path / "d.parquet")
    texts, source = load_texts(str(tmp_path / "d.parquet"), text_field="content")
    assert source == "file:d.parquet" and "".join(texts) == text
    with pytest.raises(DataError, match="no column 'text'"):
        load_texts(str(tmp_path / "d.parquet"))
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(DataError, match="bad.jsonl:2"):
        load_texts(str(tmp_path / "bad.jsonl"))
    plan = plan_tokens(char_tokenizer, data=str(tmp_path / "d.parquet"), text_field="content", tokens=500,
                       seq_len=100, heldout_tokens=50, seed=3)
    assert plan.tokens == 500 and len(plan.heldout[0]) == 50
    assert plan.sha256() == plan_tokens(char_tokenizer, data=str(tmp_path / "d.parquet"), text_field="content",
                                        tokens=500, seq_len=100, heldout_tokens=50, seed=3).sha256()


def test_hub_dataset_offline_is_one_clear_error(monkeypatch, char_tokenizer):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match="cannot load dataset"):
        load_texts("some-org/some-dataset")


def test_embedded_halves_do_not_overlap(char_tokenizer):
    a = plan_tokens(char_tokenizer, tokens=2000, seq_len=500, heldout_tokens=100, corpus_split="calibration")
    b = plan_tokens(char_tokenizer, tokens=2000, seq_len=500, heldout_tokens=100, corpus_split="heldout")
    assert a.source.endswith("[calibration]") and b.source.endswith("[heldout]")
    assert a.sha256() != b.sha256()


def test_embedded_code_is_a_second_corpus_split_in_halves(char_tokenizer):
    texts, source = load_texts(EMBEDDED_CODE)
    assert source.startswith("embedded-code:stdlib[argparse,")
    assert len(texts) == len(CODE_MODULES) and "class ArgumentParser" in texts[0]
    assert texts[-1] == Path(importlib.util.find_spec(CODE_MODULES[-1]).origin).read_text(encoding="utf-8")
    assert "pydoc" not in source and set(texts).isdisjoint(load_texts("embedded")[0])
    kw = dict(data=EMBEDDED_CODE, tokens=2000, seq_len=500, heldout_tokens=500, heldout_seqs=2)
    cal = plan_tokens(char_tokenizer, **kw, corpus_split="calibration")
    held = plan_tokens(char_tokenizer, **kw, corpus_split="heldout")
    assert held.source.endswith("[heldout]") and cal.source.endswith("[calibration]")
    cal_rows = {tuple(s.tolist()) for s in cal.calibration + cal.heldout}
    assert not cal_rows & {tuple(s.tolist()) for s in held.heldout}
    assert held.sha256() == plan_tokens(char_tokenizer, **kw, corpus_split="heldout").sha256()   # deterministic
    assert embedded_code_texts() == texts


def test_same_embedded_text_tells_another_pythons_corpus(tmp_path, monkeypatch):
    """An artifact's calibration tokens are rebuilt from its record on this interpreter's corpus:
    equal here (one held-out sequence or two), different once the corpus text changes (another
    Python's pydoc_data), unknown for a record without a digest or of a file."""
    from factories import calibrate_tiny, loaded_tiny

    from oscar_calib.contract.artifact import load_artifact
    from oscar_calib.data import corpus

    lm = loaded_tiny()
    records = []
    for name, seqs in (("one", 1), ("two", 2)):
        calibrate_tiny(tmp_path / name, loaded=lm, heldout_seqs=seqs)
        records.append(json.loads(load_artifact(tmp_path / name).metadata["calibration"]))
        assert corpus.same_embedded_text(records[-1], lm.tokenizer) is True
    texts, label = corpus.EMBEDDED_SOURCES["embedded"]
    monkeypatch.setitem(corpus.EMBEDDED_SOURCES, "embedded", (lambda: [t.replace(" the ", " teh ") for t in texts()],
                                                               label))
    assert [corpus.same_embedded_text(r, lm.tokenizer) for r in records] == [False, False]
    assert corpus.same_embedded_text({**records[0], "token_sha256": None}, lm.tokenizer) is None
    assert corpus.same_embedded_text({**records[0], "data": "notes.txt"}, lm.tokenizer) is None


def test_eval_names_an_artifact_calibrated_on_another_text(tmp_path, monkeypatch):
    from factories import calibrate_tiny, loaded_tiny

    from oscar_calib.data import corpus
    from oscar_calib.eval import EvalOptions, run_eval

    lm = loaded_tiny()
    calibrate_tiny(tmp_path / "a", loaded=lm)
    opts = EvalOptions(methods="bf16,oscar", sequences=1, seq_len=64)
    assert not run_eval("tiny", tmp_path / "a", opts, loaded=lm).settings.get("notes")
    texts, label = corpus.EMBEDDED_SOURCES["embedded"]
    monkeypatch.setitem(corpus.EMBEDDED_SOURCES, "embedded", (lambda: [t.replace(" the ", " teh ") for t in texts()],
                                                               label))
    notes = run_eval("tiny", tmp_path / "a", opts, loaded=lm).settings.get("notes")
    assert any("calibrated on another text than this Python's embedded corpora" in n for n in notes)
