"""The teacher-forced negative log-likelihood of a token sequence with K/V stored as a KV-cache
method stores them: simulated in one forward pass (:func:`sequence_nll`, through
:class:`~oscar_calib.runtime.simulate.SimulatedKV`), or through a real cache one decode step per
scored prediction (:func:`cache_nll`; :func:`real_cache_nll` for :class:`~oscar_calib.runtime.OscarCache`,
:func:`quanto_sequence_nll` for quanto's). What ``oscar eval``'s perplexity sums."""

from __future__ import annotations

import torch

from ..errors import InputError
from ..model.placement import input_device
from ..runtime.scheme import KVScheme
from ..runtime.simulate import SimulatedKV
from .methods import quanto_cache


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


__all__ = ["cache_nll", "quanto_sequence_nll", "real_cache_nll", "sequence_nll"]
