"""What ``oscar eval`` runs: one typed options object, validated once, on construction.

=================  ======  ======================================================================
field              task    meaning (default)
=================  ======  ======================================================================
``task``           both    ``ppl`` (held-out perplexity) or ``niah`` (needle in a haystack)
``methods``        both    methods to compare, a tuple or comma-separated text
                           (:data:`~.methods.DEFAULT_METHODS`: bf16, hadamard, oscar, fork)
``group_size``     both    INT2 group size (None: the artifact's, else ``min(128, head_dim)``)
``logit_correction`` both  gain of ``oscar``'s logit-noise correction (None: the artifact's)
``sink``           both    first tokens kept in BF16 (:data:`~oscar_calib.contract.defaults.DEFAULT_SINK`)
``recent``         both    last tokens kept in BF16 (:data:`~oscar_calib.contract.defaults.DEFAULT_RECENT`)
``seed``           both    chooses the held-out sequences / the needles (0)
``sequences``      ppl     held-out sequences (1: the default set runs in about a minute on a CPU)
``seq_len``        ppl     tokens per sequence (2048)
``data``           ppl     ``embedded`` / ``embedded-code`` (a corpus' held-out half) or a file or directory
``contexts``       ppl     long contexts, a tuple or comma-separated text (none): ``sequences`` windows of
                           each length, the last ``scored`` predictions of each scored
                           (:mod:`.context`); none: windows of ``seq_len``, every prediction scored
``scored``         ppl     predictions scored at the end of each window (None:
                           :func:`scored_predictions`)
``real_cache``     ppl     score through :class:`~oscar_calib.runtime.OscarCache` itself (prefill, then
                           one decode step per scored prediction) instead of the simulation (False)
``lengths``        niah    context lengths, a tuple or comma-separated text (1024 … 8192)
``depths``         niah    needle depths in [0, 1] (0, 0.25, 0.5, 0.75, 1)
``samples``        niah    prompts per (length, depth) (1)
``prompts``        niah    at least this many prompts per length: sets ``samples`` to
                           ``ceil(prompts / len(depths))`` (None: use ``samples``)
``haystack``       niah    filler: ``corpus`` (held-out sentences), ``noise`` (RULER's) or ``prose``
                           (generated, the same on every Python: :mod:`.haystack`)
``max_new_tokens`` niah    answer tokens generated (12)
``prefill_chunk``  niah    tokens per prefill forward pass (2048)
=================  ======  ======================================================================

Every field is checked in :meth:`EvalOptions.__post_init__`, whatever the task, so a bad value is
one :class:`~oscar_calib.errors.InputError` naming the ``oscar eval`` option before any model loads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..contract.defaults import (
    DEFAULT_RECENT,
    DEFAULT_SINK,
    check_group_size,
    check_logit_correction,
    check_window,
)
from ..errors import InputError
from .methods import DEFAULT_METHODS, parse_methods

TASKS = ("ppl", "niah")
# predictions scored at the end of a long-context window (--context): the last 1,024, or the second half
# of a window shorter than 2,048 tokens
CONTEXT_SCORED = 1024
# NIAH filler: held-out corpus sentences, RULER's repeated noise, or prose generated from a committed grammar
# (the same text on every Python; eval.haystack)
HAYSTACKS = ("corpus", "noise", "prose")


def parse_numbers(value, kind, option: str) -> tuple:
    """``value`` (comma-separated text or a sequence) as a tuple of ``kind``."""
    items = [x for x in value.split(",") if x.strip()] if isinstance(value, str) else list(value)
    try:
        return tuple(kind(x) for x in items)
    except (TypeError, ValueError):
        raise InputError(f"{option} expects comma-separated numbers, got {value!r}") from None


def _positive(option: str, n) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InputError(f"{option} must be a positive integer, got {n!r}")


@dataclass(frozen=True)
class EvalOptions:
    """The settings of one evaluation (see the module docstring); immutable and validated."""

    task: str = "ppl"
    methods: tuple[str, ...] = DEFAULT_METHODS
    group_size: int | None = None
    logit_correction: float | None = None
    sink: int = DEFAULT_SINK
    recent: int = DEFAULT_RECENT
    seed: int = 0
    sequences: int = 1
    seq_len: int = 2048
    data: str = "embedded"
    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    samples: int = 1
    prompts: int | None = None
    haystack: str = "corpus"
    max_new_tokens: int = 12
    prefill_chunk: int = 2048
    contexts: tuple[int, ...] = ()
    scored: int | None = None
    real_cache: bool = False

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise InputError(f"unknown --task {self.task!r}; choose from {', '.join(TASKS)}")
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen)
        set_("methods", tuple(parse_methods(self.methods)))
        set_("lengths", parse_numbers(self.lengths, int, "--lengths"))
        set_("depths", parse_numbers(self.depths, float, "--depths"))
        if self.group_size is not None:
            check_group_size(None, self.group_size)
        if self.logit_correction is not None:
            set_("logit_correction", check_logit_correction(self.logit_correction))
        check_window(self.sink, self.recent)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise InputError(f"--seed must be an integer, got {self.seed!r}")
        for option, n in (("--sequences", self.sequences), ("--samples", self.samples),
                          ("max_new_tokens", self.max_new_tokens), ("prefill_chunk", self.prefill_chunk)):
            _positive(option, n)
        _positive("--seq-len", self.seq_len - 1)          # at least one prediction
        if not self.data:
            raise InputError("--data is empty")
        if not self.lengths or any(n < 1 for n in self.lengths):
            raise InputError(f"--lengths must be positive integers, got {list(self.lengths)}")
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise InputError(f"--depths must lie in [0, 1], got {list(self.depths)}")
        if self.prompts is not None:
            _positive("--prompts", self.prompts)
            if self.samples != 1 and self.samples != -(-self.prompts // len(self.depths)):
                raise InputError("give --samples or --prompts, not both")
            set_("samples", -(-self.prompts // len(self.depths)))
        if self.haystack not in HAYSTACKS:
            raise InputError(f"unknown haystack {self.haystack!r}; choose from {', '.join(HAYSTACKS)}")
        set_("contexts", parse_numbers(self.contexts, int, "--context"))
        if any(n < 2 for n in self.contexts):
            raise InputError(f"--context lengths must be at least 2 tokens, got {list(self.contexts)}")
        if self.scored is not None:
            _positive("--scored", self.scored)
            for n in self.contexts or (self.seq_len,):
                if self.scored > n - 1:
                    raise InputError(f"--scored {self.scored} is more than the {n - 1} predictions a window of {n} "
                                     "tokens makes")
        if not isinstance(self.real_cache, bool):
            raise InputError(f"real_cache must be True or False, got {self.real_cache!r}")
        if self.task == "niah" and (self.contexts or self.scored is not None or self.real_cache):
            raise InputError("--context, --scored and --real-cache are for --task ppl (niah always decodes through "
                             "the real cache)")

    def scored_at(self, length: int) -> int:
        """Predictions scored in a window of ``length`` tokens: ``scored`` when given, else
        :func:`scored_predictions`."""
        return self.scored if self.scored is not None else scored_predictions(length, bool(self.contexts))

    def replace(self, **changes) -> "EvalOptions":
        return dataclasses.replace(self, **changes)


def scored_predictions(length: int, long: bool = True) -> int:
    """Predictions scored by default in a window of ``length`` tokens: at a long context the last
    :data:`CONTEXT_SCORED` (half the window below ``2 × CONTEXT_SCORED`` tokens), so every scored
    token reads a history nearly as long as the window; otherwise (``long`` False: the held-out
    windows of ``seq_len``) all ``length − 1``."""
    if not long:
        return length - 1
    return min(CONTEXT_SCORED, max(1, length // 2))


def options_for(options: EvalOptions | None, task: str | None = None) -> EvalOptions:
    """``options`` (None: the defaults) for ``task`` (None: the one it names)."""
    if options is None:
        return EvalOptions(task=task or "ppl")
    if not isinstance(options, EvalOptions):
        raise TypeError(f"expected an oscar_calib.eval.EvalOptions, got {type(options).__name__}")
    return options if task is None or options.task == task else options.replace(task=task)
