"""Held-out perplexity, teacher-forced, faithful to decoding (see :mod:`oscar_calib.runtime.simulate`).

``quanto`` has no simulation: it decodes the text token by token through a real ``QuantizedCache``.
"""

from __future__ import annotations

import math
import time

import torch

from ..model.placement import input_device
from ..progress import ProgressFn, counter
from ..runtime.scheme import KVScheme
from ..runtime.simulate import SimulatedKV
from .methods import (
    QUANTO_DEFAULTS,
    bits_of,
    build_schemes,
    engine_settings,
    fork_settings,
    quanto_cache,
)
from .options import EvalOptions, options_for
from .report import EvalResult


def heldout_sequences(tokenizer, *, sequences: int = 2, seq_len: int = 2048, data: str = "embedded",
                      seed: int = 0) -> list[torch.Tensor]:
    """``sequences`` windows of ``seq_len`` tokens from the held-out half of the embedded corpus
    (``embedded-code``: of the embedded code corpus; or from a file ``data``), chosen by ``seed``."""
    from ..data.corpus import plan_tokens

    plan = plan_tokens(tokenizer, data=data, tokens=seq_len, seq_len=seq_len, heldout_tokens=seq_len,
                       heldout_seqs=sequences, seed=seed, corpus_split="heldout")
    return plan.heldout


def _decoder_and_head(model):
    from ..model.geometry import decoder_module, text_config

    dec = decoder_module(model)
    head = model.get_output_embeddings()
    cap = getattr(text_config(model.config), "final_logit_softcapping", None)
    return dec, head, cap


def _nll_from_hidden(model, hidden: torch.Tensor, targets: torch.Tensor, chunk: int = 256) -> float:
    """Σ −log p(target) over positions, with the LM head applied in chunks (Gemma's vocabulary
    is 262K: full logits of 2K tokens would be 2 GB)."""
    _, head, cap = _decoder_and_head(model)
    total = 0.0
    for a in range(0, hidden.shape[1], chunk):
        logits = head(hidden[:, a:a + chunk]).float()
        if cap:
            logits = torch.tanh(logits / cap) * cap
        lp = torch.log_softmax(logits, dim=-1)
        total -= float(lp.gather(-1, targets[:, a:a + chunk].to(lp.device).unsqueeze(-1)).sum())
    return total


@torch.no_grad()
def sequence_nll(model, ids: torch.Tensor, scheme: KVScheme | None = None) -> tuple[float, int]:
    """Sum of teacher-forced NLL over ``ids`` [1, T] (T − 1 predictions) with K/V read as
    ``scheme`` stores them (None: the model's own attention)."""
    dev = input_device(model)     # a spread model: where its inputs go
    ids = ids.to(dev)
    dec, _, _ = _decoder_and_head(model)
    if scheme is None:
        hidden = dec(input_ids=ids, use_cache=False).last_hidden_state
    else:
        with SimulatedKV(model, scheme):
            hidden = dec(input_ids=ids, use_cache=False).last_hidden_state
    return _nll_from_hidden(model, hidden[:, :-1], ids[:, 1:]), ids.shape[1] - 1


@torch.no_grad()
def quanto_sequence_nll(model, ids: torch.Tensor, progress=None, make_cache=None) -> tuple[float, int]:
    """Teacher-forced NLL decoding ``ids`` token by token through a quanto ``QuantizedCache``
    (or the cache ``make_cache(config)`` returns: a lossless one checks the loop itself)."""
    dev = input_device(model)     # a spread model: where its inputs go
    ids = ids.to(dev)
    cache = (make_cache or quanto_cache)(model.config)
    dec, _, _ = _decoder_and_head(model)
    total, n = 0.0, ids.shape[1] - 1
    for t in range(n):
        h = dec(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).last_hidden_state
        total += _nll_from_hidden(model, h, ids[:, t + 1:t + 2])
        if progress and t % 256 == 0:
            progress(t, n)
    return total, n


def evaluate_ppl(lm, options: EvalOptions | None = None, *, artifact=None,
                 progress: ProgressFn | None = None) -> EvalResult:
    """Held-out perplexity of every method of ``options`` (see the module docstring); ``progress``
    hears one stage per method."""
    t0 = time.perf_counter()
    o = options_for(options, "ppl")
    methods, group_size, sink, recent = list(o.methods), o.group_size, o.sink, o.recent
    sequences, seq_len, data, seed = o.sequences, o.seq_len, o.data, o.seed
    from ..data.corpus import EMBEDDED_SOURCES
    schemes = build_schemes(methods, lm.geometry, artifact=artifact, group_size=group_size, sink=sink, recent=recent,
                            logit_correction=o.logit_correction)
    seqs = heldout_sequences(lm.tokenizer, sequences=sequences, seq_len=seq_len, data=data, seed=seed)
    rows, timings = [], {}
    for m in methods:
        t1 = time.perf_counter()
        nll = n = 0
        if m == "quanto":        # token by token: count tokens
            tick = counter(progress, "perplexity: quanto", sum(len(s) - 1 for s in seqs), "tokens")
        else:
            tick = counter(progress, f"perplexity: {m}", len(seqs), "sequences")
        for i, s in enumerate(seqs):
            if m == "quanto":
                a, b = quanto_sequence_nll(lm.model, s.unsqueeze(0), progress=lambda d, tot, before=n: tick(before + d))
            else:
                a, b = sequence_nll(lm.model, s.unsqueeze(0), schemes[m])
            nll, n = nll + a, n + b
            tick(n if m == "quanto" else i + 1)
        sch = schemes.get(m)
        row = {"method": m, "ppl": math.exp(nll / n), "nll": nll / n, "tokens": n, "bits_per_element": bits_of(m, sch),
               "group_size": QUANTO_DEFAULTS["q_group_size"] if m == "quanto" else (sch.group_size if sch else None)}
        if sch is not None and sch.quantized and not sch.uniform_groups:
            row["layer_group_sizes"] = [list(sch.groups(i)) for i in range(sch.num_layers)]   # a bit budget
        if sch is not None and sch.logit_correction:
            row["logit_correction"] = sch.logit_correction
        if sch is not None and (sch.sink, sch.recent) != (sink, recent):
            row.update(sink=sch.sink, recent=sch.recent)     # the fork methods: the artifact's windows
        rows.append(row)
        timings[m] = time.perf_counter() - t1
    by = {r["method"]: r["ppl"] for r in rows}
    for r in rows:   # share of the Hadamard → BF16 gap this method closes
        if "bf16" in by and "hadamard" in by and by["hadamard"] != by["bf16"]:
            r["gap_closed_vs_hadamard"] = (by["hadamard"] - r["ppl"]) / (by["hadamard"] - by["bf16"])
    settings = {"methods": methods, "sink": sink, "recent": recent, "sequences": len(seqs), "seq_len": seq_len,
                "data": f"{EMBEDDED_SOURCES[data][1]}[heldout]" if data in EMBEDDED_SOURCES else data, "seed": seed, "group_size": next((s.group_size for s in schemes.values() if s.quantized),
                                                               group_size),
                "artifact": str(artifact.path) if artifact is not None and artifact.path else None,
                "quanto": dict(QUANTO_DEFAULTS) if "quanto" in methods else None}
    fork = fork_settings(schemes, artifact)
    if fork:
        settings["fork"] = fork
    engines = engine_settings(schemes)
    if engines:
        settings["engines"] = engines
    timings["total_s"] = time.perf_counter() - t0
    return EvalResult("ppl", lm.source.model_id, settings, rows, timings)
