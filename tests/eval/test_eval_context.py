"""Perplexity at long contexts (``oscar eval --context``) and through the real cache (``--real-cache``):
the simulation equal to OscarCache with a BF16 window, the prefill of the unscored positions, the
windows and what fits, the rows and their bits, recording, the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from factories import assert_one_line_error, loaded_tiny, oscar, sharpen, tiny_model

from oscar_calib.errors import DataError, InputError
from oscar_calib.eval import (
    EvalOptions,
    context_windows,
    evaluate_ppl,
    heldout_sequences,
    real_cache_nll,
    sequence_nll,
)
from oscar_calib.model.geometry import geometry_of
from oscar_calib.runtime import KVScheme, OscarCache
from oscar_calib.runtime.simulate import SimulatedKV


def hadamard(model, *, group_size=16, sink=4, recent=16, window_dtype=torch.bfloat16):
    geo = geometry_of(model)
    return KVScheme.uniform("hadamard", geo.num_layers, geo.num_kv_heads, geo.head_dim, group_size,
                            rotation="hadamard", clips=(0.96, 0.92), sink=sink, recent=recent,
                            window_dtype=window_dtype)


@pytest.mark.parametrize("kind, seed", [("gemma3", 0), ("llama", 1)])
def test_simulation_reads_the_bf16_window_as_the_real_cache_holds_it(kind, seed):
    """OscarCache stores its window rotated and rounded to BF16 after the rotation,
    ``bf16(bf16(k) @ R)``; the simulation reads the same rows (rotated back). Every position
    decoded one token at a time through the real cache against one simulated forward pass: the
    logits agree within 1e-3 (7e-5 / 2e-5 here: BF16 roundings that float32 summation order tips
    the other way). The simulation that read the window as ``bf16(k)`` differed by 3.3e-2 / 9.9e-3,
    with the INT2 history moving the logits by about 0.16 / 0.1."""
    m = sharpen(tiny_model(kind, layers=2, head_dim=32))
    sch = hadamard(m)
    ids = torch.randint(1, 120, (1, 96), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        with SimulatedKV(m, sch, prefill=1):
            sim = m(ids).logits
        plain = m(ids).logits
        cache = OscarCache(m.config, sch)
        with cache.attach(m):
            real = torch.cat([m(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(96)], 1)
    assert cache.layers[-1].store.history_span() > 0
    assert (sim - real).abs().max() < 1e-3
    assert (sim - plain).abs().max() > 5e-2                    # the INT2 history really moved them
    # the package's two perplexity paths: all predictions, and the last ones after a prefill
    for scored in (None, 40):
        a, n = sequence_nll(m, ids, sch, scored=scored)
        b, n2 = real_cache_nll(m, ids, sch, scored=scored)
        assert n == n2 == (95 if scored is None else 40)
        assert a == pytest.approx(b, rel=1e-5)


def test_prefill_rows_attend_at_full_precision_and_blocks_change_nothing():
    """Rows below ``prefill`` equal plain attention over the keys as computed; the later rows equal
    the simulation without a prefill; query rows taken a few at a time give the same output."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 60, 16), 3 * torch.randn(1, 2, 60, 16), torch.randn(1, 2, 60, 16)
    sch = KVScheme.uniform("h", 1, 2, 16, 8, rotation="hadamard", clips=(0.96, 0.92), sink=4, recent=10)
    plain = KVScheme.full_precision(1, window_dtype=None)
    full = SimulatedKV(None, sch).attend(0, q, k, v, None, 0.25, None, None)
    pre = SimulatedKV(None, sch, prefill=30)
    got = pre.attend(0, q, k, v, None, 0.25, None, None)
    ref = SimulatedKV(None, plain).attend(0, q, k, v, None, 0.25, None, None)
    assert torch.allclose(got[:, :30], ref[:, :30], atol=1e-6) and torch.allclose(got[:, 30:], full[:, 30:], atol=1e-6)
    assert (got[:, 20:30] - full[:, 20:30]).abs().max() > 1e-3          # there INT2 was read without the prefill
    pre.row_elements = 500                                              # 3 query rows per block
    assert torch.allclose(pre.attend(0, q, k, v, None, 0.25, None, None), got, atol=1e-6)
    with pytest.raises(ValueError, match="prefill"):
        SimulatedKV(None, sch, prefill=-1)


def test_context_windows_are_the_heldout_windows_and_a_short_text_says_what_fits(char_tokenizer, tmp_path):
    a = context_windows(char_tokenizer, 512, sequences=2, seed=3)
    b = heldout_sequences(char_tokenizer, sequences=2, seq_len=512, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and all(len(x) == 512 for x in a)
    text = tmp_path / "short.txt"
    text.write_text("abcdefghij" * 100)                     # 1,001 tokens with EOS
    assert len(context_windows(char_tokenizer, 400, sequences=2, data=str(text))) == 2
    with pytest.raises(DataError) as e:
        context_windows(char_tokenizer, 600, sequences=2, data=str(text))
    assert str(e.value) == ("file:short.txt has 1,001 tokens for this tokenizer: 2 window(s) of 600 need 1,200; it "
                            "holds 1 window(s) of 600 (--sequences 1); 2 window(s) of up to 500 tokens fit "
                            "(--context); --data FILE takes a longer text")


def test_options_for_long_contexts():
    o = EvalOptions(contexts="4096,1000")
    assert o.contexts == (4096, 1000) and o.scored_at(4096) == 1024 and o.scored_at(1000) == 500
    assert EvalOptions().scored_at(2048) == 2047 and EvalOptions(scored=100).scored_at(2048) == 100
    for bad, msg in ((dict(contexts="8k"), "--context expects comma-separated numbers"),
                     (dict(contexts="1"), "at least 2 tokens"),
                     (dict(contexts="64", scored=64), "--scored 64 is more than the 63 predictions"),
                     (dict(scored=0), "--scored must be a positive integer"),
                     (dict(task="niah", real_cache=True), "are for --task ppl")):
        with pytest.raises(InputError, match=msg):
            EvalOptions(**bad)


def test_evaluate_at_long_contexts_simulated_and_through_the_real_cache():
    """Rows per method and length, each with its path, scored count, distance to BF16 and the bits
    the real cache holds with its windows (falling towards the history's as the context grows);
    the real cache scores what the simulation scores."""
    lm = loaded_tiny("gemma3", head_dim=32)
    sharpen(lm.model)
    opts = EvalOptions(methods="bf16,hadamard", group_size=16, sink=4, recent=8, sequences=1, contexts="48,96",
                       scored=16)
    sim = evaluate_ppl(lm, opts)
    real = evaluate_ppl(lm, opts.replace(real_cache=True))
    rows = {(r["method"], r["context"]): r for r in sim.rows}
    assert set(rows) == {(m, n) for m in ("bf16", "hadamard") for n in (48, 96)}
    assert all(r["scored"] == 16 and r["tokens"] == 16 and r["path"] == "simulation" for r in sim.rows)
    h48, h96 = rows[("hadamard", 48)], rows[("hadamard", 96)]
    assert h48["vs_bf16"] == pytest.approx(h48["ppl"] / rows[("bf16", 48)]["ppl"] - 1)
    assert h48["bits_per_element"] == 4.0 and 4.0 < h96["bits_at_context"] < h48["bits_at_context"] < 16
    assert sim.settings["contexts"] == [48, 96] and sim.settings["scored"] == {"48": 16, "96": 16}
    for r, s in zip(real.rows, sim.rows):
        assert r["path"] == ("real" if r["method"] == "hadamard" else "simulation")
        assert r["ppl"] == pytest.approx(s["ppl"], rel=1e-5)
    assert real.settings["notes"] == ["bf16: scored by the simulation: nothing is quantised (the simulation reads its "
                                      "16-bit keys and values, as a 16-bit cache holds them)"]
    # without --context: the seq_len windows, every prediction; the same numbers as the plain evaluation
    plain = evaluate_ppl(lm, EvalOptions(methods="bf16,hadamard", group_size=16, sink=4, recent=8, sequences=1,
                                         seq_len=48))
    again = evaluate_ppl(lm, EvalOptions(methods="bf16,hadamard", group_size=16, sink=4, recent=8, sequences=1,
                                         seq_len=48, real_cache=True))
    assert "context" not in again.rows[0] and again.settings["seq_len"] == 48
    assert [r["ppl"] for r in again.rows] == pytest.approx([r["ppl"] for r in plain.rows], rel=1e-5)


def test_context_bits_are_what_the_real_cache_holds():
    """``context_bits`` against ``OscarCache.memory()`` (16 / compression) for a full-attention and a
    sliding layer (window 8) after 40 tokens."""
    from oscar_calib.runtime.compat import layer_windows
    from oscar_calib.runtime.storage import context_bits

    m = tiny_model("gemma3", layers=2, head_dim=32)
    sch = hadamard(m, sink=2, recent=6)
    cache = OscarCache(m.config, sch)
    ids = torch.randint(1, 120, (1, 40), generator=torch.Generator().manual_seed(0))
    with cache.attach(m), torch.no_grad():
        m(ids, past_key_values=cache, use_cache=True)
    mem = cache.memory()
    assert context_bits(sch, layer_windows(m.config), 40) == pytest.approx(16 * mem["bytes"] / mem["bf16_bytes"])
    assert context_bits(sch, [None, None], 10 ** 6) == pytest.approx(sch.bits_per_element, rel=1e-4)


def test_record_keeps_long_contexts_in_their_own_table(tmp_path):
    from factories import calibrate_tiny

    from oscar_calib.eval.report import EvalResult, record_eval

    art = tmp_path / "a"
    calibrate_tiny(art)
    settings = {"sink": 64, "recent": 256, "sequences": 1, "data": "x", "group_size": 64, "contexts": [4096, 8192],
                "scored": {"4096": 1024, "8192": 1024}, "paths": {"bf16": "simulation (SimulatedKV)"}}
    rows = [{"method": m, "context": n, "scored": 1024, "ppl": p, "bits_per_element": b, "bits_at_context": c,
             "vs_bf16": v} for m, n, p, b, c, v in (("bf16", 4096, 8.0, 16.0, 16.0, 0.0), ("oscar", 4096, 8.4, 2.5, 3.3, 0.05),
                                                     ("bf16", 8192, 7.5, 16.0, 16.0, 0.0),
                                                     ("oscar", 8192, 8.1, 2.5, 2.9, 0.08))]
    before = json.loads((art / "calibration.json").read_text()).get("eval_results", {}).get("ppl")
    record_eval(art, EvalResult("ppl", "m", settings, rows))
    report = json.loads((art / "calibration.json").read_text())
    assert report["eval_results"].get("ppl") == before                   # the main table is untouched
    assert report["eval"]["long_ppl"] == {"4096": {"bf16": 8.0, "oscar": 8.4}, "8192": {"bf16": 7.5, "oscar": 8.1}}
    text = report["eval_results"]["text"]
    assert "the last 1,024 predictions" in text and "8.400 (+5.00%; 3.30 b)" in text
    card = (art / "README.md").read_text()
    assert "8,192 tokens: BF16 7.500, this artifact 8.100 (+8.0%)" in card
    # the card shows the picture drawn from the table it stores
    assert "](eval-context.png)" in card and (art / "eval-context.png").read_bytes()[:4] == b"\x89PNG"
    assert not (art / "eval-niah.png").exists() and "eval-niah.png" not in card


def test_card_names_long_contexts_shortest_first(tmp_path):
    """The stored report sorts its keys as text ("16384" before "8192"); the card's sentence reads
    the lengths in numeric order."""
    from factories import calibrate_tiny

    from oscar_calib.eval.report import EvalResult, record_eval

    art = tmp_path / "a"
    calibrate_tiny(art)
    settings = {"sink": 64, "recent": 256, "sequences": 1, "data": "x", "group_size": 64, "contexts": [8192, 16384],
                "scored": {"8192": 1024, "16384": 1024}, "paths": {"bf16": "simulation (SimulatedKV)"}}
    rows = [{"method": m, "context": n, "scored": 1024, "ppl": p, "bits_per_element": 2.5, "bits_at_context": 3.0,
             "vs_bf16": 0.0} for m, n, p in (("bf16", 8192, 8.0), ("oscar", 8192, 8.4), ("bf16", 16384, 6.0),
                                             ("oscar", 16384, 6.6))]
    record_eval(art, EvalResult("ppl", "m", settings, rows))
    card = (art / "README.md").read_text()
    assert card.index("8,192 tokens: BF16 8.000") < card.index("16,384 tokens: BF16 6.000")


def test_cli_eval_context(monkeypatch, tmp_path):
    from oscar_calib.eval.report import EvalResult

    seen = {}
    rows = [{"method": m, "context": 4096, "scored": 1024, "path": "simulation", "ppl": p, "bits_per_element": b,
             "bits_at_context": c, "vs_bf16": v} for m, p, b, c, v in (("bf16", 8.0, 16.0, 16.0, 0.0),
                                                                        ("hadamard", 9.0, 2.5, 3.4, 0.125))]

    def fake(model, artifact, options, **kw):
        seen.update(options=options)
        return EvalResult("ppl", "m", {"sink": 64, "recent": 256, "sequences": 1, "group_size": 64,
                                       "data": "embedded:pydoc_data.topics[heldout]",
                                       "contexts": [4096], "scored": {"4096": 1024},
                                       "paths": {"bf16": "simulation (SimulatedKV)"}}, rows)

    monkeypatch.setattr("oscar_calib.eval.run_eval", fake)
    monkeypatch.chdir(tmp_path)
    r = oscar("eval", "smollm2-135m", "--methods", "bf16,hadamard", "--context", "4096", "--sequences", "1",
              "--real-cache", "--scored", "512")
    assert r.exit_code == 0, r.output
    assert seen["options"] == EvalOptions(methods=("bf16", "hadamard"), contexts=(4096,), sequences=1, scored=512,
                                          real_cache=True)
    out = " ".join(r.stdout.split())
    assert "ppl at long contexts" in out and "9.000 (+12.50%; 3.40 b)" in out and "topics[heldout]" in out
    r = oscar("eval", "smollm2-135m", "--methods", "bf16,hadamard", "--context", "4096", "--json")
    assert json.loads(r.stdout)["settings"]["contexts"] == [4096]
    r = oscar("eval", "smollm2-135m", "--task", "niah", "--context", "4096")
    assert_one_line_error(r.exit_code, r.stderr, "--context, --scored and --real-cache are for --task ppl")
    assert math.isfinite(rows[1]["ppl"])


def test_plot_against_length(tmp_path):
    from oscar_calib.eval.report import EvalResult, write_plot

    rows = [{"method": m, "context": n, "ppl": p} for m, n, p in (("bf16", 4096, 8.0), ("oscar", 4096, 8.4),
                                                                  ("bf16", 8192, 7.5), ("oscar", 8192, 8.1))]
    write_plot(tmp_path / "p.png", EvalResult("ppl", "m", {"sink": 64, "recent": 256, "contexts": [4096, 8192]}, rows))
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
