"""NIAH intervals and paired tests (oscar_calib/eval/stats.py), and where they show: the summary,
``--json``, the text table, the recorded card, ``--prompts``; scripts/experiments/niah_gpu.py's merge and record."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from factories import assert_one_line_error, load_script, oscar

from oscar_calib.errors import InputError
from oscar_calib.eval import EvalOptions, EvalResult, eval_text, record_eval
from oscar_calib.eval.stats import format_rate, paired_p_value, wilson_interval


def _score_bound(k: int, n: int, upper: bool, z: float = 1.959963984540054) -> float:
    """The Wilson bound found the other way: the p where the score statistic |k/n - p| / sqrt(p(1-p)/n)
    reaches z, by bisection on the side of k/n asked for."""
    phat = k / n
    lo, hi = (phat, 1.0) if upper else (0.0, phat)
    if (upper and k == n) or (not upper and k == 0):
        return phat
    f = lambda p: abs(phat - p) / math.sqrt(p * (1 - p) / n) - z  # noqa: E731
    for _ in range(200):
        mid = (lo + hi) / 2
        inside = f(mid) < 0
        if upper:
            lo, hi = (mid, hi) if inside else (lo, mid)
        else:
            lo, hi = (lo, mid) if inside else (mid, hi)
    return (lo + hi) / 2


@pytest.mark.parametrize("k,n", [(0, 10), (5, 10), (50, 50), (1, 1), (37, 50), (3, 55)])
def test_wilson_interval_equals_the_inverted_score_test(k, n):
    low, high = wilson_interval(k, n)
    assert low == pytest.approx(_score_bound(k, n, upper=False), abs=1e-9)
    assert high == pytest.approx(_score_bound(k, n, upper=True), abs=1e-9)
    assert 0.0 <= low <= k / n <= high <= 1.0


def test_wilson_interval_known_values():
    # textbook values (Wilson 1927; Newcombe 1998, method 3) at 95%
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=5e-5)
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=5e-5)
    assert wilson_interval(50, 50) == pytest.approx((0.9287, 1.0), abs=5e-5)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(11, 10)
    assert format_rate(0.62, (0.48, 0.7449)) == "0.62 [0.48, 0.74]"


def test_paired_p_value_is_the_exact_mcnemar_test():
    a = [1] * 6 + [0] * 4 + [1] * 10
    b = [0] * 6 + [0] * 4 + [1] * 10              # 6 prompts only a gets right, none only b
    assert paired_p_value(a, b) == pytest.approx(2 / 2 ** 6)
    assert paired_p_value(b, a) == paired_p_value(a, b)
    c = [1, 0, 1, 0, 1, 1, 0, 0]
    d = [0, 1, 0, 1, 1, 1, 0, 0]                   # 2 vs 2 discordant: no evidence
    assert paired_p_value(c, d) == 1.0
    e, f = [1] * 8 + [0] * 2, [0] * 8 + [1] * 2   # 8 vs 2 of 10 discordant
    assert paired_p_value(e, f) == pytest.approx(2 * sum(math.comb(10, i) for i in range(3)) / 2 ** 10)
    assert paired_p_value([1, 1], [1, 1]) == 1.0
    with pytest.raises(ValueError):
        paired_p_value([1], [1, 0])


def _niah_result(correct: dict, n: int = 10) -> EvalResult:
    """A NIAH result with ``correct[(method, length)]`` right answers out of ``n`` prompts per cell."""
    rows = [{"method": m, "length": length, "depth": 0.5, "seed": i, "score": int(i < k),
             "bits_per_element": 16.0 if m == "bf16" else 2.5, "answer": "", "expected": "1"}
            for (m, length), k in correct.items() for i in range(n)]
    lengths = sorted({length for _, length in correct})
    return EvalResult("niah", "m", {"depths": [0.5], "samples": n, "haystack": "corpus", "lengths": lengths,
                                    "sink": 4, "recent": 8, "methods": ["bf16", "oscar"], "seed": 0}, rows)


def test_summary_json_and_text_carry_the_interval():
    res = _niah_result({("bf16", 1024): 10, ("bf16", 2048): 5, ("oscar", 1024): 5, ("oscar", 2048): 0})
    summ = {s["method"]: s for s in res.to_json()["summary"]}
    assert summ["oscar"]["by_length_interval"]["1024"] == pytest.approx(wilson_interval(5, 10), abs=1e-4)
    assert summ["oscar"]["by_length_interval"]["2048"] == pytest.approx(wilson_interval(0, 10), abs=1e-4)
    assert summ["bf16"]["interval"] == pytest.approx(wilson_interval(15, 20), abs=1e-4)
    assert summ["bf16"]["by_length_n"] == {"1024": 10, "2048": 10}
    text = eval_text({"niah": res.to_json()})
    assert "10 prompts per length" in text
    oscar_line = next(line for line in text.splitlines() if line.startswith("oscar"))
    assert "0.50 [0.24, 0.76]" in oscar_line and "0.00 [0.00, 0.28]" in oscar_line and "0.25 [0.11, 0.47]" in oscar_line


def test_recorded_card_shows_the_interval(demo_artifact, tmp_path):
    art = tmp_path / "a"
    shutil.copytree(demo_artifact, art)
    record_eval(art, _niah_result({("bf16", 1024): 10, ("oscar", 1024): 5}))
    report = json.loads((art / "calibration.json").read_text())
    assert report["eval"]["niah_interval"]["oscar"] == pytest.approx(wilson_interval(5, 10), abs=1e-4)
    assert report["eval"]["niah_prompts"] == {"bf16": 10, "oscar": 10}
    assert "0.50 [0.24, 0.76]" in report["eval_results"]["text"]
    card = (art / "README.md").read_text()
    assert "| **this artifact** | – | 50% [24%, 76%] |" in card and "10 prompts per method" in card
    assert "](eval-niah.png)" in card and (art / "eval-niah.png").read_bytes()[:4] == b"\x89PNG"
    assert "eval-context.png" not in card


def test_prompts_option_sets_samples():
    assert EvalOptions(task="niah", prompts=50).samples == 10                 # 5 default depths
    assert EvalOptions(task="niah", prompts=7, depths="0,1").samples == 4
    assert EvalOptions(task="niah", prompts=50).replace(lengths=(2048,)).samples == 10
    with pytest.raises(InputError, match="not both"):
        EvalOptions(task="niah", prompts=50, samples=3)
    with pytest.raises(InputError, match="--prompts"):
        EvalOptions(task="niah", prompts=0)


def test_cli_prompts_and_interval_table(monkeypatch):
    import oscar_calib.eval as ev

    seen = {}

    def fake_run_eval(model, artifact, options, **kw):
        seen["options"] = options
        return _niah_result({("bf16", 1024): 10, ("oscar", 1024): 5})

    monkeypatch.setattr(ev, "run_eval", fake_run_eval)
    r = oscar("eval", "smollm2-135m", "--task", "niah", "--prompts", "50", "--lengths", "1024")
    assert r.exit_code == 0, r.output
    assert seen["options"].samples == 10 and seen["options"].prompts == 50
    assert "0.50 [0.24, 0.76]" in r.stdout and "1.00 [0.72, 1.00]" in r.stdout
    r = oscar("eval", "smollm2-135m", "--task", "niah", "--prompts", "50", "--samples", "2")
    assert_one_line_error(r.exit_code, r.stderr, "not both")


def _script():
    return load_script("experiments/niah_gpu.py")


@pytest.mark.script
def test_niah_gpu_script_merges_and_records(demo_artifact, tmp_path, capsys):
    script = _script()
    art = tmp_path / "a"
    shutil.copytree(demo_artifact, art)
    sha = script.artifact_sha256(art)
    parts = []
    for i, length in enumerate((1024, 32000)):
        res = _niah_result({("bf16", length): 9 - i, ("oscar", length): 4 + i}).to_json()
        res["settings"]["artifact_sha256"] = sha
        parts.append(tmp_path / f"{length}.json")
        parts[-1].write_text(json.dumps(res))
    script.main(["--merge", *map(str, parts), "--out", str(tmp_path / "all.json")])
    merged = json.loads((tmp_path / "all.json").read_text())
    assert merged["settings"]["lengths"] == [1024, 32000] and len(merged["rows"]) == 40
    oscar = next(s for s in merged["summary"] if s["method"] == "oscar")
    assert oscar["by_length"] == {"1024": 0.4, "32000": 0.5} and oscar["samples"] == 20
    out = capsys.readouterr().out
    oscar_line = next(line for line in out.splitlines() if line.startswith("oscar"))
    assert "0.40 [0.17, 0.69]" in oscar_line and "0.50 [0.24, 0.76]" in oscar_line and "bf16 vs oscar:" in out
    script.main(["--record", str(tmp_path / "all.json"), str(art)])
    report = json.loads((art / "calibration.json").read_text())
    assert report["eval"]["niah"]["oscar"] == 0.45 and report["eval"]["niah"]["lengths"] == [1024, 32000]
    # a result made with another artifact is refused, not recorded
    (art / "oscar.safetensors").write_bytes((art / "oscar.safetensors").read_bytes() + b" ")
    with pytest.raises(SystemExit, match="not the artifact the run used"):
        script.main(["--record", str(tmp_path / "all.json"), str(art)])


@pytest.mark.script
def test_niah_gpu_records_the_second_artifact_as_oscar(demo_artifact, tmp_path):
    """An artifact that ran as ``oscar-new`` is recorded with those rows as its ``oscar``; the first
    artifact's rows stay out of its card."""
    script = _script()
    art = tmp_path / "new"
    shutil.copytree(demo_artifact, art)
    res = _niah_result({("bf16", 1024): 9, ("oscar", 1024): 2, ("oscar-new", 1024): 7}).to_json()
    res["settings"].update(artifact_sha256="0" * 64, new_artifact=str(art),
                           new_artifact_sha256=script.artifact_sha256(art), methods=["bf16", "oscar", "oscar-new"])
    (tmp_path / "r.json").write_text(json.dumps(res))
    script.main(["--record", str(tmp_path / "r.json"), str(art)])
    report = json.loads((art / "calibration.json").read_text())
    assert report["eval"]["niah"]["oscar"] == 0.7 and "oscar-new" not in report["eval"]["niah"]
    niah = report["eval_results"]["niah"]
    assert {r["method"] for r in niah["rows"]} == {"bf16", "oscar"} and niah["settings"]["methods"] == ["bf16", "oscar"]
    assert niah["settings"]["artifact_sha256"] == script.artifact_sha256(art)
