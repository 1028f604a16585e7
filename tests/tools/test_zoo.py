"""oscar zoo: empty and populated zoos, the deterministic index and the markdown table generated from it."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from factories import make_artifact, oscar

from oscar_calib.contract.artifact import WEIGHTS_NAME, read_metadata
from oscar_calib.tools import zoo


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("OSCAR_CACHE", str(root))
    return root


def test_empty_zoo(tmp_path, empty_cache):
    root = tmp_path / "zoo"
    root.mkdir()
    assert zoo.list_entries(root) == []
    result = oscar("zoo", "list", "--zoo", str(root), "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["entries"] == []
    assert "the zoo is empty" in oscar("zoo", "list", "--zoo", str(root)).stderr
    assert oscar("zoo", "index", "--zoo", str(root), "--check").exit_code == 1   # no index yet
    assert oscar("zoo", "index", "--zoo", str(root)).exit_code == 0
    index = json.loads((root / "index.json").read_text())
    assert index == {"entries": [], "format": "oscar-zoo-index", "format_version": 1, "upstream": index["upstream"]}
    assert len(index["upstream"]) == 4             # the upstream seed models (configs/), with their pull recipe
    assert oscar("zoo", "index", "--zoo", str(root), "--check").exit_code == 0
    table = oscar("zoo", "table", "--zoo", str(root))
    assert table.exit_code == 0 and table.stdout.startswith("_The zoo is empty: no artifacts are committed yet._\n")
    assert "`oscar pull rotationzoo:qwen3-8b`" in table.stdout


@pytest.fixture
def populated(zoo_smollm2, tmp_path, empty_cache) -> Path:
    root = tmp_path / "zoo"
    entry = root / "smollm2-135m"
    shutil.copytree(zoo_smollm2, entry)
    digest = read_metadata(entry)["content_sha256"]                 # verify.json verified this content
    (entry / "verify.json").write_text(json.dumps({"passed": True, "content_sha256": digest,
                                                   "summary": {"max_abs_error": 0.002}, "per_layer": [1, 2, 3]}))
    report = json.loads((entry / "calibration.json").read_text())
    report["eval"] = {"wikitext2_ppl": 21.5, "wikitext2_ppl_bf16": 21.1, "note": "tiny run"}
    (entry / "calibration.json").write_text(json.dumps(report))
    pulled = make_artifact(empty_cache / "zoo" / "hf" / "some-org" / "tiny-oscar")
    (pulled / ".oscar-pull.json").write_text(json.dumps({"source": "hf:some-org/tiny-oscar"}))
    return root


def test_list_populated_zoo_with_quality(populated, zoo_smollm2):
    entries = zoo.list_entries(populated)
    assert [(e.name, e.source) for e in entries] == [("smollm2-135m", "zoo"), ("hf/some-org/tiny-oscar", "hf")]
    mine, pulled = entries
    summary = json.loads((zoo_smollm2 / "calibration.json").read_text())["summary"]
    assert mine.quality["mean_attn_error_oscar"] == summary["mean_attn_error_oscar"]
    assert mine.quality["layers_better_than_hadamard"] == summary["layers_better_than_hadamard"]
    assert (mine.model_id, mine.num_layers, mine.num_kv_heads, mine.head_dim) == \
        ("HuggingFaceTB/SmolLM2-135M-Instruct", 30, 3, 64)
    assert mine.verified is True and mine.verification == "yes"
    assert mine.verify == {"passed": True, "max_abs_error": 0.002, "content_sha256": mine.content_sha256}
    assert mine.eval["wikitext2_ppl"] == 21.5
    assert pulled.remote == "hf:some-org/tiny-oscar" and pulled.verified is None
    result = oscar("zoo", "list", "--zoo", str(populated), "--json")
    assert result.exit_code == 0
    assert [e["name"] for e in json.loads(result.stdout)["entries"]] == ["smollm2-135m", "hf/some-org/tiny-oscar"]
    text = oscar("zoo", "list", "--zoo", str(populated), "--no-cache").stdout
    assert "smollm2-135m" in text and "tiny-oscar" not in text


def test_index_is_deterministic_and_drives_the_table(populated):
    path, index = zoo.write_index(populated)
    first = path.read_bytes()
    zoo.write_index(populated)
    assert path.read_bytes() == first and zoo.index_is_current(populated)
    (entry,) = index["entries"]                   # pulled artifacts are not part of the committed index
    assert entry["path"] == "smollm2-135m" and entry["source"] == "zoo"
    assert entry["sha256"] == hashlib.sha256((populated / "smollm2-135m" / WEIGHTS_NAME).read_bytes()).hexdigest()
    table = zoo.markdown_table(zoo.load_index(populated))
    q = entry["quality"]
    assert (f"| [`smollm2-135m`](zoo/smollm2-135m) | `HuggingFaceTB/SmolLM2-135M-Instruct` | 30 × 3 × 64 | "
            f"u_h_pbr, head | {q['mean_attn_error_oscar']:.4f} / {q['mean_attn_error_hadamard']:.4f} | yes | "
            "wikitext2_ppl 21.500, wikitext2_ppl_bf16 21.100 |") in table
    # a new artifact makes the committed index stale until it is regenerated
    make_artifact(populated / "tiny")
    result = oscar("zoo", "index", "--zoo", str(populated), "--check")
    assert result.exit_code == 1 and "stale" in result.stderr
    assert oscar("zoo", "index", "--zoo", str(populated)).exit_code == 0
    assert [e["name"] for e in zoo.load_index(populated)["entries"]] == ["smollm2-135m", "tiny"]


def test_damaged_entry_is_listed_not_fatal(tmp_path, empty_cache):
    root = tmp_path / "zoo"
    art = make_artifact(root / "broken")
    (art / WEIGHTS_NAME).write_bytes(b"\x00" * 4)
    (entry,) = zoo.list_entries(root)
    assert entry.error and "truncated" in entry.error and entry.model_id is None
    assert oscar("zoo", "list", "--zoo", str(root)).exit_code == 0


def test_committed_index_is_current():
    root = Path(__file__).resolve().parents[2] / "zoo"
    assert zoo.index_is_current(root), "zoo/index.json is stale: run `oscar zoo index`"
    assert zoo.load_index(root)["format"] == "oscar-zoo-index"
