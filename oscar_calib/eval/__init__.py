"""``oscar eval``: held-out perplexity and needle-in-a-haystack retrieval with a 2-bit KV cache.

Methods: ``bf16``, ``naive``, ``hadamard``, ``oscar``, ``fork``, ``fork-lloyd``, ``vllm``, ``llamacpp`` and
``quanto``; what the KV cache holds in each, and which group size and windows it uses, is in
:mod:`.methods`.

The package holds the measurements of an artifact on held-out data: this evaluation, and
:mod:`.verify` (``oscar verify``: the INT2 kernels on held-out activations against a Hadamard
baseline, the pass/fail gate recorded in ``verify.json``).

Settings are one typed :class:`~oscar_calib.eval.options.EvalOptions`, validated once.

Perplexity (``task="ppl"``) is teacher-forced on held-out text (the embedded corpus' ``heldout``
half by default: one sequence of 2048 tokens), faithful to decoding: for every query position
``i``, key/value ``j`` is read in BF16 when ``j < sink`` or ``i − j < recent`` and as INT2 (rotated,
clipped, quantised, stored with fp16 scale/offset exactly as :mod:`oscar_calib.kernels` stores it)
otherwise. It runs in one forward pass per sequence through an attention function registered with
transformers' ``AttentionInterface`` (:class:`SimulatedKV`) that computes the scores with both key
versions and picks per (i, j), and splits the probabilities into their BF16 and INT2 parts for
``P·V``; the model's causal and sliding-window masks and GQA are honoured, math is float32. With
nothing quantised it equals plain attention (tested). ``quanto`` has no such simulation: it
decodes the text token by token through a real ``QuantizedCache``. At long contexts
(``contexts``) the last predictions of long windows are scored after a full-precision prefill, by
the simulation or through the real :class:`~oscar_calib.runtime.OscarCache` (``real_cache``):
:mod:`.context`.

Needle in a haystack (``task="niah"``, RULER's ``niah_single`` style): a needle "One of the
special magic numbers for {key} is: {value}." (a random word pair and a 7-digit number) is placed
at several depths of filler text (held-out corpus sentences, or RULER's repeated "noise"
sentences), followed by the question. The prompt (all but its last token) is prefilled once in
full precision, as a serving engine prefills; each method's cache is built from that prefill
(INT2 history written exactly as :class:`~oscar_calib.runtime.cache.OscarCache` writes it), and
``model.generate`` answers greedily from the last prompt token, so every answer token, the first
included, is decoded through the method's cache. Score: 1 when the first number in the answer
equals the value, else 0.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import EvalError
from ..progress import ProgressFn
from .context import context_windows, evaluate_context
from .methods import (
    DEFAULT_METHODS,
    METHODS,
    QUANTO_DEFAULTS,
    bits_of,
    build_schemes,
    parse_methods,
    quanto_cache,
    resolve_methods,
)
from .niah import evaluate_niah, make_niah, score_niah
from .nll import cache_nll, quanto_sequence_nll, real_cache_nll, sequence_nll
from .options import TASKS, EvalOptions, options_for
from .ppl import evaluate_ppl, heldout_sequences
from .report import EvalResult, eval_headline, eval_text, record_eval, write_plot


def _same_text(art, tokenizer) -> bool:
    """False only when the artifact's calibration record names an embedded corpus whose tokens this
    interpreter does not reproduce (:func:`~oscar_calib.data.corpus.same_embedded_text`)."""
    import json

    from ..data.corpus import same_embedded_text

    try:
        record = json.loads(art.metadata.get("calibration") or "{}")
    except ValueError:
        return True
    return same_embedded_text(record, tokenizer) is not False


def run_eval(model: str, artifact_path: Path | None, options: EvalOptions | None = None, *, loaded=None,
             device: str = "auto", dtype: str = "auto", plot: Path | None = None,
             progress: ProgressFn | None = None, placement=None) -> EvalResult:
    """Validate the artifact (``oscar validate``'s rules), load the model (or take ``loaded``, a
    :class:`~oscar_calib.model.load.LoadedModel`; ``placement`` spreads a big one over GPUs, CPU
    and disk, :class:`~oscar_calib.model.placement.Placement`), run ``options.task`` and write the plot. Without
    an artifact the methods that need one are left out (:func:`~.methods.resolve_methods`). ``options``
    None: the defaults (perplexity). Used by ``oscar eval``."""
    from ..contract.artifact import load_artifact, require_compatible
    from ..data.corpus import EMBEDDED_SOURCES, check_data_path
    from ..model.load import load_model

    opts = options_for(options)
    art = None
    if artifact_path is not None:
        art = load_artifact(Path(artifact_path))     # every check of oscar validate: its first line
    methods, notes = resolve_methods(opts.methods, art)
    opts = opts.replace(methods=methods)
    if opts.task == "ppl":
        check_data_path(opts.data)           # a mistyped --data file: one line before the model loads
    lm = loaded or load_model(model, device=device, dtype=dtype, placement=placement, progress=progress)
    if art is not None:
        require_compatible(art, lm.geometry, lm.fingerprint, model_name=lm.source.model_id)
        if opts.task == "ppl" and opts.data in EMBEDDED_SOURCES and not _same_text(art, lm.tokenizer):
            notes = notes + [f"{artifact_path} was calibrated on another text than this Python's embedded corpora "
                             "(its calibration tokens do not match here: another Python's pydoc_data and standard "
                             "library, or another tokenizer); perplexities measured here are not comparable with "
                             "the ones on its card"]
    fn = evaluate_ppl if opts.task == "ppl" else evaluate_niah
    result = fn(lm, opts, artifact=art, progress=progress)
    if notes:
        result.settings["notes"] = notes + result.settings.get("notes", [])
    if plot is not None:
        write_plot(Path(plot), result)
        result.settings["plot"] = str(plot)
    return result


__all__ = ["DEFAULT_METHODS", "EvalError", "EvalOptions", "EvalResult", "METHODS", "QUANTO_DEFAULTS", "TASKS", "bits_of", "build_schemes",
           "cache_nll", "context_windows", "eval_headline", "eval_text", "evaluate_context", "evaluate_niah",
           "evaluate_ppl", "heldout_sequences", "make_niah", "parse_methods", "quanto_cache", "quanto_sequence_nll",
           "real_cache_nll", "record_eval", "run_eval", "score_niah", "sequence_nll", "write_plot"]
