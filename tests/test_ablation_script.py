"""scripts/experiments/ablation.py's table: a NIAH column attached from scripts/experiments/niah_gpu.py
results (--niah, --render), in this process."""

import json

import pytest
from factories import load_script, script_error

pytestmark = pytest.mark.script


def _module():
    return load_script("experiments/ablation.py")


def _results():
    settings = {"model": "m", "eval_sequences": 2, "eval_seq_len": 64, "sink": 4, "recent": 8, "calibration_seed": 0,
                "heldout_tokens": 32, "texts": ["embedded"]}
    rows = {"bf16": {"ppl": {"embedded": 8.0}, "bits_per_element": 16.0, "group_size": None},
            "default": {"ppl": {"embedded": 8.4}, "bits_per_element": 2.5, "group_size": 64}}
    return {"settings": settings, "rows": rows, "command": "python scripts/experiments/ablation.py m"}


def _niah(tmp_path, name="n.json", rates=(("bf16", 0.5), ("oscar", 0.25))):
    summ = [{"method": m, "by_length": {"1024": 0.1, "8192": r}, "by_length_interval": {"1024": [0, 0.2], "8192": [r - 0.1, r + 0.1]},
             "by_length_n": {"1024": 50, "8192": 50}} for m, r in rates]
    p = tmp_path / name
    p.write_text(json.dumps({"summary": summ, "settings": {"haystack_sha256": "abcd" * 4}}))
    return p


def test_niah_column_from_the_largest_length(tmp_path):
    mod = _module()
    res = _results()
    p = _niah(tmp_path)
    mod.attach_niah(res, [f"default={p}:oscar", f"bf16={p}:bf16"])
    assert res["rows"]["default"]["niah"]["length"] == 8192 and res["rows"]["default"]["niah"]["rate"] == 0.25
    text = mod.table(res)
    assert "NIAH, largest length [95%]" in text
    assert "| default | 64 | 2.500 | 8.400 (+5.00%, –) | 0.25 [0.15, 0.35] at 8192 (a) |" in text
    assert "filler sha256 abcdabcdabcdabcd" in text
    assert "NIAH" not in mod.table(_results())      # no column without NIAH


@pytest.mark.parametrize("spec, message", [
    ("default", "expected VARIANT=RESULT.json:METHOD"),
    ("nope={p}:oscar", "no row 'nope'"),
    ("default={p}:fork", "no NIAH rates for method 'fork'"),
    ("default={missing}:oscar", "cannot read"),
])
def test_niah_spec_errors(tmp_path, spec, message):
    mod = _module()
    p = _niah(tmp_path)
    with pytest.raises(SystemExit, match=message):
        mod.attach_niah(_results(), [spec.format(p=p, missing=tmp_path / "missing.json")])


def test_render_writes_the_table_without_a_model(tmp_path, capsys):
    out = tmp_path / "abl.json"
    out.write_text(json.dumps(_results()))
    p = _niah(tmp_path)
    _module().main(["--render", "--out", str(out), "--niah", f"default={p}:oscar"])
    md = out.with_suffix(".md").read_text()
    assert "0.25 [0.15, 0.35] at 8192 (a)" in md and "NIAH attached with: `python scripts/experiments/ablation.py --render" in md
    assert json.loads(out.read_text())["rows"]["default"]["niah"]["method"] == "oscar"
    assert "0.25 [0.15, 0.35] at 8192 (a)" in capsys.readouterr().out
    assert script_error(_module().main, ["--render", "--out", str(tmp_path / "none.json")]) == (
        "error: --render needs --out naming an existing ablation JSON")
