"""Perplexity at long contexts (``oscar eval --context 8192,32768``), and through the real cache
(``--real-cache``).

A 2-bit cache exists for long contexts, where nearly every token a query reads comes from the
INT2 history. The measure here is the loss of the **last** predictions of long windows:

* for each length ``L``, ``sequences`` windows of ``L`` consecutive tokens of held-out text
  (:func:`context_windows`: the held-out half of an embedded corpus, or a file, cut into windows of
  ``L`` and chosen by ``seed``, the same rule as the ``seq_len`` windows of ``oscar eval``);
* the first ``L − 1 − N`` tokens of a window are prefilled at full precision, as a serving engine
  prefills a prompt; each of the last ``N`` predictions is made by a decode step that reads the
  cache as stored (BF16 sink and recent window, every older token from the INT2 history);
* ``N`` (``--scored``) is 1,024 by default, half the window below 2,048 tokens
  (:func:`~oscar_calib.eval.options.scored_predictions`): every scored token reads a history of at
  least ``L − 1 − N`` tokens, so the figure belongs to the length, not to a mix of short and long
  histories. (The OSCAR fork's README scores every token at position 4,096 and later of 32,768-token
  windows: most of its scored tokens read a shorter history.) The scored tokens sit at the end of
  the window, so a text shorter than ``L`` cannot stand in for it: a corpus too short for the
  windows asked is refused in one line that says what fits.

Two ways to score, the same numbers (tested on small models; the simulation models the real
cache's window exactly, :func:`~oscar_calib.runtime.simulate.window_rows`):

=================  ==========================================================================
path               what runs
=================  ==========================================================================
simulation         one forward pass per window through
(default)          :class:`~oscar_calib.runtime.simulate.SimulatedKV` (prefill rows in full
                   precision, the scored rows per query position): any device, any method
``--real-cache``   :class:`~oscar_calib.runtime.OscarCache` itself (:func:`~.nll.real_cache_nll`):
                   its prefill, then one decode step per scored prediction (the Triton write and
                   decode kernels on CUDA, their torch path elsewhere); for ``naive``,
                   ``hadamard`` and ``oscar``. ``bf16`` (nothing quantised) and the engines'
                   schemes (``fork``, ``vllm``, ``llamacpp``), which this cache cannot store, are
                   scored by the simulation and named so; ``quanto`` always decodes through its
                   own cache
=================  ==========================================================================

Every row says its path, its length and how many predictions it scored, the history's bits per
element and the bits the real cache holds at that length with its windows counted
(:func:`~oscar_calib.runtime.storage.context_bits`).
"""

from __future__ import annotations

import math
import time

import torch

from ..errors import DataError
from ..progress import ProgressFn, counter
from .methods import (
    QUANTO_DEFAULTS,
    build_schemes,
    gap_closed,
    method_fields,
    scheme_settings,
)
from .nll import quanto_sequence_nll, real_cache_nll, sequence_nll
from .options import EvalOptions, options_for
from .report import EvalResult

PATHS = {"simulation": "simulation (SimulatedKV)", "real": "real cache (OscarCache)",
         "quanto": "real cache (QuantizedCache)"}


def context_windows(tokenizer, length: int, *, sequences: int = 2, data: str = "embedded",
                    seed: int = 0) -> list[torch.Tensor]:
    """``sequences`` windows of ``length`` consecutive tokens of held-out text: ``data``'s token
    stream (an embedded corpus' held-out half) cut into windows of ``length``, the first
    ``sequences`` of a ``seed``-driven permutation (at ``seq_len`` the windows
    :func:`~.ppl.heldout_sequences` gives). A text too short for them is one
    :class:`~oscar_calib.errors.DataError` line saying what fits."""
    from ..data.corpus import pick_windows, token_windows

    windows, stream, source = token_windows(tokenizer, length, data=data, corpus_split="heldout")
    full = [w for w in windows if len(w) == length]
    if len(full) < sequences:
        fits = f"it holds {len(full)} window(s) of {length:,} (--sequences {len(full)}); " if full else ""
        raise DataError(f"{source} has {len(stream):,} tokens for this tokenizer: {sequences} window(s) of "
                        f"{length:,} need {sequences * length:,}; {fits}{sequences} window(s) of up to "
                        f"{len(stream) // sequences:,} tokens fit (--context); --data FILE takes a longer text")
    return [full[i] for i in pick_windows(sequences, len(full), seed)]


def scoring_path(method: str, scheme, real_cache: bool) -> str:
    """Which :data:`PATHS` entry scores ``method``: ``quanto`` its own cache; with ``real_cache`` every
    scheme :class:`~oscar_calib.runtime.OscarCache` can store; the simulation otherwise."""
    from ..runtime.cache import not_storable

    if method == "quanto":
        return "quanto"
    if real_cache and scheme is not None and not_storable(scheme) is None:
        return "real"
    return "simulation"


def evaluate_context(lm, options: EvalOptions | None = None, *, artifact=None,
                     progress: ProgressFn | None = None) -> EvalResult:
    """Perplexity of every method of ``options`` over the last predictions of windows of each
    length of ``options.contexts`` (none: the ``seq_len`` windows, every prediction), by the
    simulation or, with ``options.real_cache``, through the real cache (module docstring).
    ``progress`` hears one stage per length and method."""
    from ..data.corpus import EMBEDDED_SOURCES
    from ..runtime.compat import layer_windows
    from ..runtime.storage import context_bits

    t0 = time.perf_counter()
    o = options_for(options, "ppl")
    methods = list(o.methods)
    schemes = build_schemes(methods, lm.geometry, artifact=artifact, group_size=o.group_size, sink=o.sink,
                            recent=o.recent, logit_correction=o.logit_correction)
    lengths = list(o.contexts) or [o.seq_len]
    windows = {n: context_windows(lm.tokenizer, n, sequences=o.sequences, data=o.data, seed=o.seed)
               for n in lengths}           # every length checked before any is scored
    layer_w = layer_windows(lm.model.config)
    paths = {m: scoring_path(m, schemes.get(m), o.real_cache) for m in methods}
    rows, timings = [], {}
    for n in lengths:
        scored = o.scored_at(n)
        for m in methods:
            sch = schemes.get(m)
            t1 = time.perf_counter()
            label = f"perplexity at {n:,}: {m}" if o.contexts else f"perplexity: {m}"
            steps = paths[m] != "simulation"
            tick = counter(progress, label, len(windows[n]) * (scored if steps else 1),
                           "decode steps" if steps else "sequences")
            nll = count = 0
            for i, w in enumerate(windows[n]):
                ids = w.unsqueeze(0)
                if paths[m] == "quanto":
                    a, b = quanto_sequence_nll(lm.model, ids, scored=scored,
                                               progress=lambda d, tot, before=count: tick(before + d))
                elif paths[m] == "real":
                    a, b = real_cache_nll(lm.model, ids, sch, scored=scored,
                                          progress=lambda d, tot, before=count: tick(before + d))
                else:
                    a, b = sequence_nll(lm.model, ids, sch, scored=scored)
                nll, count = nll + a, count + b
                tick(count if steps else i + 1)
            row = {"method": m, **({"context": n} if o.contexts else {}), "scored": scored, "path": paths[m],
                   "ppl": math.exp(nll / count), "nll": nll / count, "tokens": count,
                   **method_fields(m, sch, o.sink, o.recent)}
            if sch is not None and m != "quanto":
                row["bits_at_context"] = context_bits(sch, layer_w, n)
            rows.append(row)
            timings[f"{m}@{n}" if o.contexts else m] = time.perf_counter() - t1
    _relative(rows)
    settings = {"methods": methods, "sink": o.sink, "recent": o.recent, "sequences": o.sequences,
                "data": f"{EMBEDDED_SOURCES[o.data][1]}[heldout]" if o.data in EMBEDDED_SOURCES else o.data,
                "seed": o.seed, "group_size": next((s.group_size for s in schemes.values() if s.quantized),
                                                   o.group_size),
                "artifact": str(artifact.path) if artifact is not None and artifact.path else None,
                "quanto": dict(QUANTO_DEFAULTS) if "quanto" in methods else None,
                "real_cache": o.real_cache, "paths": {m: PATHS[p] for m, p in paths.items()},
                "device": str(lm.model.device)}
    if o.contexts:
        settings.update(contexts=lengths, scored={str(n): o.scored_at(n) for n in lengths})
    else:
        settings.update(seq_len=lengths[0], scored=o.scored_at(lengths[0]))
    if o.real_cache:
        from ..runtime.cache import not_storable

        notes = [f"{m}: scored by the simulation: " + ("nothing is quantised (the simulation reads its 16-bit keys "
                                                       "and values, as a 16-bit cache holds them)"
                                                       if not schemes[m].quantized
                                                       else not_storable(schemes[m]).split(": ", 1)[1])
                 for m in methods if paths[m] == "simulation"]
        if notes:
            settings["notes"] = notes
    settings.update(scheme_settings(schemes, artifact))
    timings["total_s"] = time.perf_counter() - t0
    return EvalResult("ppl", lm.source.model_id, settings, rows, timings)


def _relative(rows: list[dict]) -> None:
    """Per length: each row's perplexity over BF16's (``vs_bf16``) and the share of the Hadamard →
    BF16 gap it closes (:func:`~.methods.gap_closed`), where those methods ran."""
    for n in {r.get("context") for r in rows}:
        same = [r for r in rows if r.get("context") == n]
        bf16 = next((r["ppl"] for r in same if r["method"] == "bf16"), None)
        for r in same:
            if bf16 is not None:
                r["vs_bf16"] = r["ppl"] / bf16 - 1
        gap_closed(same)
