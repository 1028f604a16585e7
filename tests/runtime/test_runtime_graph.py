"""Decode steps of the real cache replayed from a CUDA graph (:class:`DecodeGraph`).

The replays are GPU only; they run on the GPU machine with the kernel tests. On the CPU: the
refusals, and (in ``test_runtime_storage.py``) the masked step decided on the device that makes
the step capturable."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from factories import tiny_model

from oscar_calib.errors import CacheError, InputError
from oscar_calib.runtime import DecodeGraph, generate

PROMPT = 500                                         # past sink + window: the INT2 history is in use


def _model(device, kind="qwen3", **kw):
    model = tiny_model(kind, head_dim=128, **kw)       # head_dim 128: the decode kernel's group of 128
    model.config._attn_implementation = "sdpa"
    return model.to(device, torch.bfloat16 if device == "cuda" else torch.float32)


def _cache(model, reserve, backend="auto", **window):
    from oscar_calib.kernels.testing import random_rotation
    from oscar_calib.runtime import KVScheme, OscarCache

    cfg = model.config
    g = torch.Generator().manual_seed(1)
    n, h, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    rk = [random_rotation(h, d, generator=g) for _ in range(n)]
    rv = [random_rotation(h, d, generator=g) for _ in range(n)]
    cache = OscarCache(cfg, KVScheme("oscar", n, 128, rk, rv, [torch.full((h,), 0.95)] * n,
                                     [torch.full((h,), 0.9)] * n, **window), backend=backend)
    cache.reserve(reserve)
    return cache


def _prefill(model, cache, prompt):
    with cache.attach(model), torch.no_grad():
        return model(prompt, past_key_values=cache, use_cache=True).logits[:, -1:]


@pytest.mark.gpu
def test_greedy_decode_from_the_graph_equals_eager_steps():
    model = _model("cuda")
    prompt = torch.randint(0, 128, (2, PROMPT), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    steps = 6

    eager = _cache(model, PROMPT + steps)
    logits = _prefill(model, eager, prompt)
    want = []
    with eager.attach(model), torch.no_grad():
        for i in range(steps):
            tok = logits.argmax(-1)
            logits = model(input_ids=tok, position_ids=torch.full((2, 1), PROMPT + i, device="cuda"),
                           past_key_values=eager, use_cache=True).logits
            want.append(logits.float().clone())

    graphed = _cache(model, PROMPT + steps)
    logits = _prefill(model, graphed, prompt)
    with graphed.attach(model), torch.no_grad():
        step = DecodeGraph(model, graphed)
        assert step.room >= steps
        got = []
        for i in range(steps):
            logits = step(logits.argmax(-1), torch.full((2, 1), PROMPT + i, device="cuda"))
            got.append(logits.float().clone())
    assert step.graph is not None                     # calls 2.. replayed the recorded step
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), (i, (g - w).abs().max().item())
    for a, b in zip(graphed.layers, eager.layers):    # host bookkeeping as after eager steps
        assert a.seen == b.seen == PROMPT + steps
        assert a.store.exact_counts() == b.store.exact_counts() == [PROMPT + steps] * 2
        assert torch.equal(a.store.hist.codes, b.store.hist.codes)
    with graphed.attach(model), torch.no_grad():      # and eager steps may follow the replays
        model(input_ids=torch.zeros(2, 1, dtype=torch.long, device="cuda"),
              position_ids=torch.full((2, 1), PROMPT + steps, device="cuda"), past_key_values=graphed, use_cache=True)
    assert graphed.layers[0].store.exact_counts() == [PROMPT + steps + 1] * 2


@pytest.mark.gpu
@pytest.mark.parametrize("kind,backend", [("gemma3", "auto"), ("qwen3", "torch")])
def test_graph_replays_the_torch_decode_path_as_the_history_grows(kind, backend):
    """Layers that decode in torch (a sliding layer whose ring is not full yet; every layer with
    backend="torch") would read only the history slots the host counted at recording time, and miss
    the tokens that leave the recent window after it; the recorded step reads every slot instead.
    (A recent window of 16 tokens, so that 24 steps push tokens out of it.)"""
    model = _model("cuda", kind, **({"sliding_window": 1024} if kind == "gemma3" else {}))
    prompt = torch.randint(0, 128, (2, PROMPT), device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    steps = 24
    runs = []
    for graphed in (False, True):
        cache = _cache(model, PROMPT + steps, backend, sink=4, recent=16)
        logits = _prefill(model, cache, prompt)
        out = []
        with cache.attach(model), torch.no_grad():
            step = DecodeGraph(model, cache) if graphed else None
            for i in range(steps):
                tok, pos = logits.argmax(-1), torch.full((2, 1), PROMPT + i, device="cuda")
                logits = step(tok, pos) if graphed else model(input_ids=tok, position_ids=pos, past_key_values=cache,
                                                               use_cache=True).logits
                out.append(logits.float().clone())
        runs.append(out)
    rel = [((g - w).abs().max() / w.abs().max()).item() for g, w in zip(runs[1], runs[0])]
    assert max(rel) < 2e-3, rel                         # the same logits up to summation order


@pytest.mark.gpu
def test_graph_refuses_to_run_past_the_reserved_history():
    model = _model("cuda")
    cache = _cache(model, PROMPT)
    _prefill(model, cache, torch.randint(0, 128, (1, PROMPT), device="cuda"))
    with cache.attach(model), torch.no_grad():
        step = DecodeGraph(model, cache)
        tok, pos = torch.zeros(1, 1, dtype=torch.long, device="cuda"), torch.full((1, 1), PROMPT, device="cuda")
        for _ in range(step.room):
            step(tok, pos)
        with pytest.raises(CacheError, match="reserve"):
            step(tok, pos)


def test_graph_device_is_one_gpu_or_none():
    from oscar_calib.runtime.graph import graph_device

    model = _model("cpu")
    assert graph_device(model) is None
    model.register_parameter("offloaded", torch.nn.Parameter(torch.zeros(1, device="meta")))
    assert graph_device(model) is None                     # spread or offloaded: eager steps, no graph
    with pytest.raises(InputError, match="cpu, meta"):
        DecodeGraph(model, _cache(model, 600))
    if torch.cuda.is_available():
        assert graph_device(_model("cuda")) == torch.device("cuda", torch.cuda.current_device())


def test_graph_refuses_cpu_models_other_caches_and_empty_caches():
    from transformers import DynamicCache

    model = _model("cpu")
    with pytest.raises(InputError, match="OscarCache"):
        DecodeGraph(model, DynamicCache(config=model.config))
    with pytest.raises(InputError, match="CUDA"):
        DecodeGraph(model, _cache(model, 600))
    if torch.cuda.is_available():
        gpu_model = _model("cuda")
        with pytest.raises(CacheError, match="prefilled"):
            DecodeGraph(gpu_model, _cache(gpu_model, 600))


def _padded_prompt(device, length=PROMPT, pads=37):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 128, (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    ids[1, :pads], mask[1, :pads] = 0, 0                 # row 1 left-padded
    return ids.to(device), mask.to(device)


def _generate(model, cache, ids, mask, custom, **kw):
    from oscar_calib.runtime import graph_decoding

    if custom == "compile":        # the opt-in spelled as the docs spell it
        extra = {"custom_generate": functools.partial(graph_decoding, compile=True)}
    else:
        extra = {"custom_generate": graph_decoding} if custom else {}
    with cache.attach(model), torch.no_grad():
        return model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=8, pad_token_id=0,
                              **extra, **kw)


@pytest.mark.parametrize("sample", [False, True])
def test_graph_decoding_in_generate_equals_generate(sample):
    """``generate(custom_generate=graph_decoding)`` gives generate()'s own tokens: greedy and seeded
    sampling (top-k, temperature), a left-padded batch, a row stopped by EOS and padded (CPU: eager
    steps; the GPU machine runs the graph in the test below)."""
    model = _model("cpu")
    ids, mask = _padded_prompt("cpu")
    kw = dict(do_sample=True, top_k=20, temperature=0.7) if sample else dict(do_sample=False)
    torch.manual_seed(5)
    want = _generate(model, _cache(model, 600), ids, mask, False, **kw)
    torch.manual_seed(5)
    got = _generate(model, _cache(model, 600), ids, mask, True, **kw)
    assert got.shape == (2, PROMPT + 8) and torch.equal(got, want)
    eos = int(want[0, PROMPT + 2])                      # row 0 stops at its third new token
    torch.manual_seed(5)
    want = _generate(model, _cache(model, 600), ids, mask, False, eos_token_id=eos, **kw)
    torch.manual_seed(5)
    got = _generate(model, _cache(model, 600), ids, mask, True, eos_token_id=eos, **kw)
    assert torch.equal(got, want) and (got[0, PROMPT + 3:] == 0).all()


def test_graph_decoding_takes_the_compile_option():
    """``custom_generate=functools.partial(graph_decoding, compile=True)`` passes generate()'s own
    argument checks (CPU: eager steps, where it changes nothing) and gives its tokens."""
    model = _model("cpu")
    ids, mask = _padded_prompt("cpu")
    want = _generate(model, _cache(model, 600), ids, mask, False, do_sample=False)
    assert torch.equal(_generate(model, _cache(model, 600), ids, mask, "compile", do_sample=False), want)


def test_graph_decoding_refusals():
    from transformers import DynamicCache

    from oscar_calib.runtime import graph_decoding

    model = _model("cpu")
    ids, mask = _padded_prompt("cpu", length=8, pads=0)
    with torch.no_grad():
        with pytest.raises(InputError, match="OscarCache"):
            model.generate(ids, past_key_values=DynamicCache(config=model.config), max_new_tokens=2, pad_token_id=0,
                           custom_generate=graph_decoding)
        with pytest.raises(InputError, match="num_beams"):
            model.generate(ids, past_key_values=_cache(model, 64), max_new_tokens=2, num_beams=2, pad_token_id=0,
                           custom_generate=graph_decoding)
    cache = _cache(model, 64)
    _prefill(model, cache, ids)
    with pytest.raises(InputError, match="cache holds 8 tokens and the input 8"):
        _generate(model, cache, ids, mask, True)


def _two_turns(model, ids, mask, custom):
    """A conversation: a prompt, then the answer and 50 more tokens on the same cache."""
    cache = _cache(model, 700)
    first = _generate(model, cache, ids, mask, custom, do_sample=False)
    more = torch.randint(1, 128, (ids.shape[0], 50), generator=torch.Generator().manual_seed(9)).to(ids.device)
    ids2 = torch.cat([first, more], 1)
    mask2 = torch.cat([mask, torch.ones_like(ids2[:, mask.shape[1]:])], 1)
    return first, _generate(model, cache, ids2, mask2, custom, do_sample=False), cache


def test_graph_decoding_continues_a_conversation():
    """A second generate() call on the same cache runs only the new tokens, as generate() does
    (a left-padded batch)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = _model(device)
    ids, mask = _padded_prompt(device)
    want = _two_turns(model, ids, mask, False)
    got = _two_turns(model, ids, mask, True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2].layers[0].store.exact_counts() == want[2].layers[0].store.exact_counts()


def _stored(out, mask, stop):
    """Tokens each row of a graph_decoding cache holds: its real prompt and the new tokens fed back
    before its first stop token (a finished row stores nothing more)."""
    new = out[:, PROMPT:].tolist()
    fed = [next((k for k, t in enumerate(row) if t in stop), len(row) - 1) for row in new]
    return [int(m) + f for m, f in zip(mask.sum(-1).tolist(), fed)]


@pytest.mark.gpu
def test_graph_decoding_on_the_gpu_equals_eager_generate():
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    model = _model("cuda")
    ids, mask = _padded_prompt("cuda")
    want = _generate(model, _cache(model, 600), ids, mask, False, do_sample=False)
    got = _generate(model, _cache(model, 600), ids, mask, True, do_sample=False)
    assert torch.equal(got, want)
    out = _generate(model, _cache(model, 600), ids, mask, True, do_sample=False, return_dict_in_generate=True,
                    output_scores=True)
    assert isinstance(out, GenerateDecoderOnlyOutput) and torch.equal(out.sequences, want)
    assert len(out.scores) == 8 and out.scores[0].shape == (2, model.config.vocab_size)
    # with an EOS stop the graph runs a step ahead of the stop decision; rows that finished store
    # nothing, so the step past the end leaves the cache as it was
    eos = int(want[0, PROMPT + 2])
    eager, graphed = _cache(model, 600), _cache(model, 600)
    want = _generate(model, eager, ids, mask, False, do_sample=False, eos_token_id=eos)
    got = _generate(model, graphed, ids, mask, True, do_sample=False, eos_token_id=eos)
    assert torch.equal(got, want) and (got[0, PROMPT + 3:] == 0).all()
    for a, b in zip(graphed.layers, eager.layers):
        assert a.seen == b.seen
        assert a.store.exact_counts() == _stored(got, mask, [eos])
    # both rows stop before max_new_tokens: the step run past the end is taken back
    stop = [eos, int(want[1, PROMPT + 1])]
    eager, graphed = _cache(model, 600), _cache(model, 600)
    want = _generate(model, eager, ids, mask, False, do_sample=False, eos_token_id=stop)
    got = _generate(model, graphed, ids, mask, True, do_sample=False, eos_token_id=stop)
    assert torch.equal(got, want) and got.shape[1] <= PROMPT + 3   # row 1 stops by its 2nd token, row 0 by its 3rd
    assert [a.seen for a in graphed.layers] == [b.seen for b in eager.layers]
    assert graphed.layers[0].store.exact_counts() == _stored(got, mask, stop)


@pytest.mark.gpu
def test_compiled_graph_steps_follow_eager_steps():
    """``DecodeGraph(compile=True)``: the model's own ops between the cache update and the attention
    compiled (torch.compile, per decoder layer), recorded and replayed; the logits follow eager
    steps to bf16 rounding (fused kernels round differently), and the model is left as it was."""
    model = _model("cuda")
    prompt = torch.randint(0, model.config.vocab_size, (2, PROMPT), device="cuda", generator=None)
    caches = [_cache(model, PROMPT + 16) for _ in range(2)]
    first = [_prefill(model, c, prompt) for c in caches]
    ids = first[0].argmax(-1)
    pos = torch.full((2, 1), PROMPT, device="cuda")
    eager, graph = [], []
    with caches[0].attach(model), torch.no_grad():
        for i in range(5):
            eager.append(model(ids, past_key_values=caches[0], position_ids=pos + i, use_cache=True).logits.float())
    with caches[1].attach(model), torch.no_grad():
        step = DecodeGraph(model, caches[1], compile=True)
        for i in range(5):
            graph.append(step(ids, pos + i).float().clone())
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
    for e, g in zip(eager, graph):
        assert ((e - g).norm() / e.norm()).item() < 2e-2
    assert step.graph is not None


@pytest.mark.slow
def test_compiled_layers_follow_eager_steps_on_cpu():
    """The layers ``DecodeGraph(compile=True)`` records: each decoder layer through torch.compile
    (one compiled code for all layers), the cache update and the attention left out of it; steps
    through it give the eager steps' logits (float32 here) and the model is restored after."""
    from oscar_calib.runtime.attention import ATTENTION_NAME, registered_attention
    from oscar_calib.runtime.graph import compiled_layers, decoder_layers

    torch.manual_seed(0)
    model = _model("cpu")
    prompt = torch.randint(0, model.config.vocab_size, (1, 300))

    def steps(compiled: bool) -> torch.Tensor:
        cache = _cache(model, 400)
        logits = _prefill(model, cache, prompt)
        outs = []
        with cache.attach(model), torch.no_grad():
            ids, pos = logits.argmax(-1), torch.tensor([[300]])
            for i in range(3):
                with compiled_layers(decoder_layers(model), cache, ATTENTION_NAME, registered_attention) if compiled else contextlib.nullcontext():
                    out = model(ids, past_key_values=cache, position_ids=pos + i, use_cache=True).logits[:, -1:]
                assert "update" not in cache.__dict__
                outs.append(out.float())
                ids = out.argmax(-1)
        return torch.cat(outs)

    ref, got = steps(False), steps(True)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)


def test_cache_generate_takes_the_fastest_path_that_applies():
    """``generate``: on the CPU ``fast="auto"`` runs eager steps and gives ``generate()``'s
    own tokens; ``fast=True`` and ``compile=True`` say in one line why the graph does not apply;
    beam search falls back to eager steps under ``"auto"``; a cache other than OscarCache is one
    line."""
    from transformers import DynamicCache

    from oscar_calib.runtime.graph import graph_refusal

    model = _model("cpu")
    ids, mask = _padded_prompt("cpu")
    want = _generate(model, _cache(model, 600), ids, mask, False, do_sample=False)
    with torch.no_grad():
        got = generate(model, ids, _cache(model, 600), attention_mask=mask, max_new_tokens=8, pad_token_id=0,
                       do_sample=False)
        assert torch.equal(got, want)
        for kw, match in ((dict(fast=True), r"fast=True\): no graph decoding here: the model is on cpu"),
                          (dict(compile=True), "compile=True"), (dict(fast="yes"), "fast must be")):
            with pytest.raises(InputError, match=match):
                generate(model, ids, _cache(model, 600), attention_mask=mask, max_new_tokens=2, pad_token_id=0, **kw)
    assert graph_refusal(model) == "the model is on cpu, not a GPU"
    with pytest.raises(InputError, match="generate needs an OscarCache, got DynamicCache"):
        generate(model, ids, DynamicCache(), max_new_tokens=2)


def test_graph_refusal_names_what_the_graph_does_not_run(monkeypatch):
    from oscar_calib.runtime import graph as graph_mod

    model = _model("cpu")
    monkeypatch.setattr(graph_mod, "graph_device", lambda m: torch.device("cuda", 0))   # as if on one GPU
    assert graph_mod.graph_refusal(model, max_new_tokens=4) is None
    assert "num_beams" in graph_mod.graph_refusal(model, num_beams=2)
    assert "output_attentions" in graph_mod.graph_refusal(model, output_attentions=True, return_dict_in_generate=True)
    assert "inputs_embeds" in graph_mod.graph_refusal(model, inputs_embeds=torch.zeros(1, 2, 8))
    monkeypatch.undo()
    spread = _model("cpu")
    spread.lm_head.to("meta")
    assert "offloaded" in graph_mod.graph_refusal(spread)


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_cache_generate_on_the_gpu_decodes_from_the_graph(compile, monkeypatch):
    """On one GPU ``generate`` runs ``graph_decoding`` (and its ``compile`` option): the
    tokens of ``custom_generate=graph_decoding``."""
    from oscar_calib.runtime import graph as graph_mod

    calls = []
    real = graph_mod.DecodeGraph
    monkeypatch.setattr(graph_mod, "DecodeGraph", lambda *a, **k: calls.append(k) or real(*a, **k))
    model = _model("cuda")
    ids, mask = _padded_prompt("cuda")
    want = _generate(model, _cache(model, 600), ids, mask, "compile" if compile else True, do_sample=False)
    calls.clear()
    with torch.no_grad():
        got = generate(model, ids, _cache(model, 600), attention_mask=mask, max_new_tokens=8, pad_token_id=0,
                       do_sample=False, compile=compile)
    assert calls == [{"compile": compile}]
    assert torch.equal(got, want)


def test_cache_generate_reports_prefill_and_every_token():
    """``progress``: a prefill stage, then one ``decode`` report per new token counted against
    max_new_tokens, and a last one that ends the stage; the tokens are those without it, and a
    logits processor of the caller's still runs."""
    from transformers import LogitsProcessorList

    model = _model("cpu")
    ids, mask = _padded_prompt("cpu")
    kw = dict(attention_mask=mask, max_new_tokens=6, pad_token_id=0, do_sample=False)
    reports, theirs = [], []

    def mine(input_ids, scores):
        theirs.append(input_ids.shape[-1])
        return scores

    with torch.no_grad():
        want = generate(model, ids, _cache(model, 600), **kw)
        got = generate(model, ids, _cache(model, 600), progress=lambda *r: reports.append(r),
                       logits_processor=LogitsProcessorList([mine]), **kw)
    assert torch.equal(got, want)
    n = got.shape[1] - ids.shape[1]
    assert reports[0] == (f"prefill: {PROMPT} tokens", 0, None, "")
    assert reports[1:-1] == [("decode", k, 6, "tokens") for k in range(n)]
    assert reports[-1] == ("decode", n, n, "tokens") and theirs == [PROMPT + k for k in range(n)]
