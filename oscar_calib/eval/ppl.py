"""Held-out perplexity, teacher-forced, faithful to decoding (see :mod:`oscar_calib.runtime.simulate`):
each method's NLL (:mod:`.nll`) summed over held-out windows. Long contexts, the last predictions of
a window or the real cache go to :mod:`.context`.

``quanto`` has no simulation: it decodes the text token by token through a real ``QuantizedCache``.
"""

from __future__ import annotations

import math
import time

import torch

from ..progress import ProgressFn, counter
from .methods import (
    QUANTO_DEFAULTS,
    build_schemes,
    gap_closed,
    method_fields,
    scheme_settings,
)
from .nll import quanto_sequence_nll, sequence_nll
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
