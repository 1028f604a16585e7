"""Held-out perplexity, teacher-forced, faithful to decoding (see :mod:`oscar_calib.runtime.simulate`).

``quanto`` has no simulation: it decodes the text token by token through a real ``QuantizedCache``.
"""

from __future__ import annotations

import math
import time

import torch

from ..errors import InputError
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


def _scored(ids: torch.Tensor, scored: int | None) -> int:
    n = ids.shape[1] - 1
    if scored is None:
        return n
    if not 1 <= scored <= n:
        raise InputError(f"cannot score {scored} predictions of a window of {ids.shape[1]} tokens (1 to {n})")
    return scored


@torch.no_grad()
def sequence_nll(model, ids: torch.Tensor, scheme: KVScheme | None = None, *, scored: int | None = None,
                 simulation=SimulatedKV) -> tuple[float, int]:
    """Sum of teacher-forced NLL over the last ``scored`` predictions of ``ids`` [1, T] (None: all
    T − 1) with K/V read as ``scheme`` stores them (None: the model's own attention), and that
    count. The positions before the scored ones attend at full precision, as a serving engine
    prefills a prompt; each scored one reads the cache as a decode step does
    (``simulation(model, scheme, prefill=...)``: :class:`SimulatedKV`, or a subclass that stores
    the history another way). One forward pass."""
    dev = input_device(model)     # a spread model: where its inputs go
    ids = ids.to(dev)
    k = _scored(ids, scored)
    start = ids.shape[1] - 1 - k          # the first position whose prediction is scored
    dec, _, _ = _decoder_and_head(model)
    if scheme is None:
        hidden = dec(input_ids=ids, use_cache=False).last_hidden_state
    else:                                 # the first token is a prefill even when scored: a cache starts empty
        with simulation(model, scheme, prefill=max(start, 1)):
            hidden = dec(input_ids=ids, use_cache=False).last_hidden_state
    return _nll_from_hidden(model, hidden[:, start:-1], ids[:, start + 1:]), k


@torch.no_grad()
def cache_nll(model, ids: torch.Tensor, cache, *, scored: int | None = None, chunk: int = 1,
              progress=None) -> tuple[float, int]:
    """Teacher-forced NLL of the last ``scored`` predictions of ``ids`` [1, T] (None: all T − 1)
    through a real cache (an :class:`~oscar_calib.runtime.OscarCache`, attached here, or any
    transformers ``Cache``), and that count: the positions before them prefilled in one call (the
    cache's full-precision prefill), then ``chunk`` tokens per call (1: one decode step per scored
    prediction, what :func:`sequence_nll` simulates; more: each call reads the cache as stored and
    its own tokens at full precision). ``progress(done, total)`` hears the decode steps."""
    from ..runtime.cache import attached

    if chunk < 1:
        raise InputError(f"chunk must be at least 1, got {chunk}")
    ids = ids.to(input_device(model))
    k = _scored(ids, scored)
    n = ids.shape[1] - 1
    start = n - k
    dec, _, _ = _decoder_and_head(model)
    total = 0.0
    with attached(cache, model):
        if start:
            dec(input_ids=ids[:, :start], past_key_values=cache, use_cache=True)
        for a in range(start, n, chunk):
            b = min(a + chunk, n)
            h = dec(input_ids=ids[:, a:b], past_key_values=cache, use_cache=True).last_hidden_state
            total += _nll_from_hidden(model, h, ids[:, a + 1:b + 1])
            if progress and (a - start) % 256 == 0:
                progress(a - start, k)
    return total, k


def real_cache_nll(model, ids: torch.Tensor, scheme: KVScheme, *, scored: int | None = None, chunk: int = 1,
                   backend: str = "auto", progress=None) -> tuple[float, int]:
    """:func:`cache_nll` through :class:`~oscar_calib.runtime.OscarCache` with ``scheme`` (the real
    INT2 cache: on CUDA the Triton write and decode kernels, elsewhere their torch path), room
    reserved for the whole window. With ``chunk`` 1 it equals :func:`sequence_nll` with the same
    scheme and ``scored`` (float32 summation order aside: tested)."""
    from ..runtime.cache import OscarCache

    cache = OscarCache(model.config, scheme, backend=backend)
    cache.reserve(ids.shape[-1])
    return cache_nll(model, ids, cache, scored=scored, chunk=chunk, progress=progress)


def quanto_sequence_nll(model, ids: torch.Tensor, progress=None, make_cache=None, *,
                        scored: int | None = None) -> tuple[float, int]:
    """Teacher-forced NLL through a quanto ``QuantizedCache`` (or the cache ``make_cache(config)``
    returns: a lossless one checks the loop itself): :func:`cache_nll`, token by token over the
    scored predictions (None: every token)."""
    return cache_nll(model, ids, (make_cache or quanto_cache)(model.config), scored=scored, progress=progress)


def evaluate_ppl(lm, options: EvalOptions | None = None, *, artifact=None,
                 progress: ProgressFn | None = None) -> EvalResult:
    """Held-out perplexity of every method of ``options`` (see the module docstring); ``progress``
    hears one stage per method."""
    t0 = time.perf_counter()
    o = options_for(options, "ppl")
    if o.contexts or o.real_cache or o.scored is not None:        # the last predictions, or the real cache
        from .context import evaluate_context

        return evaluate_context(lm, o, artifact=artifact, progress=progress)
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
        rows.append({"method": m, "ppl": math.exp(nll / n), "nll": nll / n, "tokens": n,
                     **method_fields(m, schemes.get(m), sink, recent)})
        timings[m] = time.perf_counter() - t1
    gap_closed(rows)
    settings = {"methods": methods, "sink": sink, "recent": recent, "sequences": len(seqs), "seq_len": seq_len,
                "data": f"{EMBEDDED_SOURCES[data][1]}[heldout]" if data in EMBEDDED_SOURCES else data, "seed": seed, "group_size": next((s.group_size for s in schemes.values() if s.quantized),
                                                               group_size),
                "artifact": str(artifact.path) if artifact is not None and artifact.path else None,
                "quanto": dict(QUANTO_DEFAULTS) if "quanto" in methods else None}
    settings.update(scheme_settings(schemes, artifact))
    timings["total_s"] = time.perf_counter() - t0
    return EvalResult("ppl", lm.source.model_id, settings, rows, timings)


def method_fields(method: str, sch: KVScheme | None, sink: int, recent: int) -> dict:
    """A perplexity row's description of what ``method`` stored: bits per history element, group
    size, per-layer sizes of a bit budget, the correction's gain, and windows other than ``sink`` /
    ``recent`` (the fork methods take the artifact's)."""
    row = {"bits_per_element": bits_of(method, sch),
           "group_size": QUANTO_DEFAULTS["q_group_size"] if method == "quanto" else (sch.group_size if sch else None)}
    if sch is not None and sch.quantized and not sch.uniform_groups:
        row["layer_group_sizes"] = [list(sch.groups(i)) for i in range(sch.num_layers)]   # a bit budget
    if sch is not None and sch.logit_correction:
        row["logit_correction"] = sch.logit_correction
    if sch is not None and (sch.sink, sch.recent) != (sink, recent):
        row.update(sink=sch.sink, recent=sch.recent)
    return row


def gap_closed(rows: list[dict]) -> None:
    """Set each row's share of the Hadamard → BF16 perplexity gap it closes
    (``gap_closed_vs_hadamard``), where both ran (rows of one length)."""
    by = {r["method"]: r["ppl"] for r in rows}
    for r in rows:
        if "bf16" in by and "hadamard" in by and by["hadamard"] != by["bf16"]:
            r["gap_closed_vs_hadamard"] = (by["hadamard"] - r["ppl"]) / (by["hadamard"] - by["bf16"])


def scheme_settings(schemes: dict, artifact) -> dict:
    """What a perplexity result's settings say about the fork's and other engines' schemes."""
    out = {}
    fork = fork_settings(schemes, artifact)
    if fork:
        out["fork"] = fork
    engines = engine_settings(schemes)
    if engines:
        out["engines"] = engines
    return out
