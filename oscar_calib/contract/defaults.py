"""The scheme's defaults and shape rules, defined once and imported everywhere else.

==========================  ==========================================================
name                        meaning
==========================  ==========================================================
``DEFAULT_SINK``            first tokens kept in BF16 (the attention sink): 64
``DEFAULT_RECENT``          last tokens kept in BF16 (the recent window): 256
``MAX_GROUP_SIZE``          INT2 group size is ``min(128, head_dim)`` by default
``BASELINE_CLIPS``          the reference repo's global (K, V) clip ratios: (0.96, 0.92)
``ORTHOGONALITY_TOL``       ``‖R Rᵀ − I‖∞`` below this (float32 rotations, float64 math)
``BITS``                    bits per quantised element code: 2
``MIN_GROUP_SIZE`` …        the bounds an artifact's metadata must keep (group size,
                            head_dim, layer and head counts, windows): see below
``K_OBJECTIVES`` …          the method names a calibration accepts (objectives,
                            compositions, granularities, key-centering fits) and
                            :func:`choose`
==========================  ==========================================================

This module imports nothing heavy (no torch), so every layer of the package can use it.
"""

from __future__ import annotations

from ..errors import InputError

DEFAULT_SINK = 64
DEFAULT_RECENT = 256
MAX_GROUP_SIZE = 128
BASELINE_CLIPS = (0.96, 0.92)
ORTHOGONALITY_TOL = 1e-5
# rotation refinement (numerics.refine; off unless --refine-steps is given): Adam's learning rate
DEFAULT_REFINE_LR = 2e-3
BITS = 2

# Bounds an artifact's metadata must keep (contract.values.check_metadata_values): what the kernels and
# engines take, and caps far above every supported model that refuse a corrupt value (a flipped
# bit, a typo, an edit) before it sizes anything.
MIN_GROUP_SIZE = 4            # smaller groups store 2 + 32/G >= 18 bits per element: more than BF16's 16
HEAD_DIM_MULTIPLE = 4         # the INT2 cache packs four 2-bit codes per byte
MAX_HEAD_DIM = 1024           # (the Triton kernels take powers of two 16..256, the torch kernels any multiple of 4)
MAX_LAYERS = 1024
MAX_HEADS = 1024              # query heads; KV heads divide them
MAX_WINDOW_TOKENS = 1 << 24   # sink + recent BF16 tokens per sequence (16,777,216)
MAX_LOGIT_CORRECTION = 4.0    # gain of the logit-noise correction (1 = the whole expected inflation)

# method names -> the accumulator (``calibration.stats``) each objective reads
K_OBJECTIVES = {"qqt": "q", "ktk": "k"}
V_OBJECTIVES = {"sst": "s", "sst-approx": "s_approx", "vtv": "v"}
COMPOSITIONS = ("u_h_pbr", "u", "h", "identity")
GRANULARITIES = ("head", "layer")
# what a calibration with key centering fits on (``center_fit``): the keys as the cache stores them,
# centered (the key objective, the clips and a bit budget's group sizes), or the raw keys, exactly as
# without centering, the mean key (``k_mean``) alone added
CENTER_FITS = ("centered", "raw")


def choose(name: str, value: str, valid) -> str:
    """``value`` if it is one of ``valid``, else :class:`InputError` listing them."""
    if value not in valid:
        raise InputError(f"unknown {name} {value!r}; choose from {', '.join(valid)}")
    return value


def is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def default_group_size(head_dim: int) -> int:
    """``min(128, head_dim)``, lowered to the largest power of two dividing head_dim."""
    g = min(MAX_GROUP_SIZE, head_dim)
    while head_dim % g or not is_power_of_two(g):
        g -= 1
    return g


def group_size_problem(group_size, head_dim: int | None = None) -> str | None:
    """Why ``group_size`` cannot be an INT2 group size (None when it can): the one rule every
    config, artifact, scheme and kernel asks. A group size is an int, a power of two, at least
    :data:`MIN_GROUP_SIZE` and, given ``head_dim`` (None: not known yet), a divisor of it."""
    if not isinstance(group_size, int) or isinstance(group_size, bool):
        return f"{group_size!r} is not an integer"
    if not is_power_of_two(group_size) or (head_dim is not None and head_dim % group_size):
        return f"{group_size} is not a power of two" + (f" dividing head_dim {head_dim}" if head_dim else "")
    if group_size < MIN_GROUP_SIZE:
        return (f"{group_size} is below the smallest group size {MIN_GROUP_SIZE} (it would store more bits per "
                "element than BF16)")
    return None


def check_group_size(head_dim: int | None, group_size: int, name: str = "group size") -> int:
    """``group_size`` if :func:`group_size_problem` finds nothing, else :class:`InputError` naming
    ``name`` (e.g. ``--group-size``)."""
    why = group_size_problem(group_size, head_dim)
    if why:
        raise InputError(f"{name} {why}")
    return group_size


def group_pair(group_size: int, v_group_size: int | None = None) -> tuple[int, int]:
    """``(G_K, G_V)``: the values take the keys' size unless given their own (the one place that
    decides it; :class:`~oscar_calib.contract.settings.GroupPair` is its typed form)."""
    return int(group_size), int(group_size if v_group_size is None else v_group_size)


def check_window(sink: int, recent: int) -> None:
    """Sink and recent-window token counts are non-negative integers."""
    for name, n in (("sink", sink), ("recent", recent)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise InputError(f"{name} tokens must be a non-negative integer, got {n!r}")


def check_clip(name: str, c: float) -> float:
    """A clip ratio lies in (0, 1]; 1 means no clipping."""
    c = float(c)
    if not 0 < c <= 1:
        raise InputError(f"clip ratio {name}={c} is outside (0, 1]")
    return c


def logit_correction_problem(gain, name: str = "--logit-correction") -> str | None:
    """Why ``gain`` cannot be the gain of the logit-noise correction (None when it can): a number
    in [0, 4] (0: off; 1: the whole expected inflation, :func:`oscar_calib.numerics.quant.logit_noise`);
    an int or a float, not a string. The one range every config, artifact, scheme and kernel asks."""
    a = float(gain) if isinstance(gain, (int, float)) and not isinstance(gain, bool) else float("nan")
    if not (a == a and 0.0 <= a <= MAX_LOGIT_CORRECTION):
        return (f"{name} must be a number in [0, {MAX_LOGIT_CORRECTION:g}] (0 = off, 1 = the expected inflation), "
                f"got {gain!r}")
    return None


def check_logit_correction(gain, name: str = "--logit-correction") -> float:
    """``gain`` as a float if :func:`logit_correction_problem` finds nothing, else :class:`InputError`."""
    why = logit_correction_problem(gain, name)
    if why:
        raise InputError(why)
    return float(gain)


# transformers model types whose attention adds a learned sink logit per query head to its softmax
# (gpt-oss's ``sinks``, passed to the attention function as ``s_aux``): an engine's INT2 decode must add it
SINK_MODEL_TYPES = ("gpt_oss",)


def centering_problem(model_type: str | None) -> str | None:
    """Why a model of ``model_type`` cannot store centered keys (None when it can): a learned
    attention-sink logit is compared with every key's logit, so centered keys would need each
    query's ``q·μ`` added back beside it, which the INT2 decode kernel (one sink logit per query
    head) does not do. The one rule ``oscar calibrate --center-keys`` and every artifact reader ask."""
    if model_type in SINK_MODEL_TYPES:
        return (f"key centering is not served for {model_type}: its attention-sink logits are compared with every "
                "key's logit, and the INT2 decode kernel cannot add each query's q·k_mean back beside them")
    return None
