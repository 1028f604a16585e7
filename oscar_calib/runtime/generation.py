"""``generate(model, input_ids, cache)``: ``model.generate`` with an :class:`~.cache.OscarCache` on
the fastest path that applies.

The cache stores and attends; it does not drive generation (transformers' ``Cache`` classes never
do: generation lives in ``GenerationMixin`` and in its ``custom_generate`` hook). This function
picks the decoding method, attaches the cache for the call and reports progress:

>>> from oscar_calib.runtime import OscarCache, generate
>>> cache = OscarCache.from_artifact("zoo/smollm2-135m", model)
>>> out = generate(model, ids, cache, max_new_tokens=256)        # graph on a GPU, eager on a CPU
"""

from __future__ import annotations

import functools

import torch

from ..errors import InputError
from ..progress import ProgressFn, report
from .cache import OscarCache
from .graph import graph_decoding, graph_refusal


def generate(model, input_ids: torch.Tensor, cache: OscarCache, *, fast: bool | str = "auto",
             compile: bool = False, progress: ProgressFn | None = None, **generate_kwargs):
    """``model.generate(input_ids, past_key_values=cache, **generate_kwargs)`` with ``cache``
    attached, on the fastest path that applies: on one GPU every new token replays a CUDA graph
    (:func:`~oscar_calib.runtime.graph.graph_decoding`; ~6x the tokens/s of eager steps on an 8B
    model), elsewhere eager steps.

    ``fast``: ``"auto"`` takes the graph where it applies and eager steps otherwise (a CPU model,
    one spread over several GPUs or offloaded, beam search, attentions or hidden states in the
    output, a hybrid model's recurrent layers: :attr:`~.cache.OscarCache.recurrent`); ``True``
    refuses with one line where the graph does not apply; ``False`` always runs eager steps.
    ``compile=True`` records the graph through ``torch.compile`` (about 30% more tokens/s at 1 x
    16K-128K on an H100, for 25-40 s of compiling at the first call of each batch size): worth it
    for long generations; it needs the graph.

    ``progress`` (:mod:`oscar_calib.progress`; :func:`oscar_calib.display.show_progress` draws it)
    hears a ``prefill`` stage, then ``decode`` with one report per new token (counted against
    ``max_new_tokens`` when given), from a logits processor: nothing is read back from the device
    for it."""
    if not isinstance(cache, OscarCache):
        raise InputError(f"generate needs an OscarCache, got {type(cache).__name__}")
    if fast not in ("auto", True, False):
        raise InputError(f"generate: fast must be 'auto', True or False, not {fast!r}")
    why = (graph_refusal(model, **generate_kwargs) or cache.recurrent) if fast is not False else "fast=False"
    if why and fast is True:
        raise InputError(f"generate(fast=True): no graph decoding here: {why} (fast='auto' falls back to eager steps)")
    if compile and why:
        raise InputError(f"generate(compile=True) compiles the graph step, which does not apply: {why}")
    if not why:
        generate_kwargs["custom_generate"] = (functools.partial(graph_decoding, compile=True) if compile
                                              else graph_decoding)
    if progress is not None:
        from transformers import LogitsProcessorList

        counter = _TokenProgress(progress, input_ids.shape[-1], generate_kwargs.get("max_new_tokens"))
        theirs = generate_kwargs.get("logits_processor") or ()
        generate_kwargs["logits_processor"] = LogitsProcessorList([*theirs, counter])
        report(progress, f"prefill: {input_ids.shape[-1]} tokens", 0, None)
    with cache.attach(model):
        out = model.generate(input_ids, past_key_values=cache, **generate_kwargs)
    if progress is not None:
        counter.finish()
    return out


class _TokenProgress:
    """A logits processor that reports decoding progress and leaves the scores as they are: it is
    called once per new token, before that token is chosen, with the sequences so far."""

    def __init__(self, progress: ProgressFn, prompt: int, total: int | None):
        self.progress, self.prompt, self.total, self.done = progress, prompt, total, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.done = input_ids.shape[-1] - self.prompt
        report(self.progress, "decode", self.done, self.total, "tokens")
        return scores

    def finish(self) -> None:
        """The stage ends with the last token (sooner than ``total`` when generation stopped)."""
        n = self.done + 1
        report(self.progress, "decode", n, n, "tokens")


__all__ = ["generate"]
