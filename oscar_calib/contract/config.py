"""Typed calibration settings. One dataclass, loadable from YAML (unknown keys rejected)."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError, OscarWarning
from .defaults import (
    CENTER_FITS,
    COMPOSITIONS,
    DEFAULT_RECENT,
    DEFAULT_REFINE_LR,
    DEFAULT_SINK,
    GRANULARITIES,
    K_OBJECTIVES,
    V_OBJECTIVES,
    check_clip,
    check_group_size,
    check_logit_correction,
    check_window,
    choose,
)


@dataclass
class CalibrationConfig:
    """Everything that decides what ``oscar calibrate`` computes.

    ``k_clip``/``v_clip`` of ``None`` mean "fit per layer and KV head"; a number fixes them.
    ``group_size`` of ``None`` means ``min(128, head_dim)``; ``bit_budget`` (bits per stored
    element, e.g. 2.5) instead chooses a group size per layer (:mod:`oscar_calib.calibration.budget`),
    and with ``split_kv`` one for the keys and one for the values of every layer.

    ``center_keys`` stores every key centered on the calibration's mean key (``k_mean``): what the
    artifact holds and every consumer must honour. ``center_fit`` (:data:`~.defaults.CENTER_FITS`)
    says only what the calibration fits on, which no consumer needs to know, so it is a second field
    rather than a third value of ``center_keys``: ``centered`` fits the key objective (``ktk``), the
    clips and a bit budget's group sizes on the centered keys; ``raw`` fits all of them on the raw
    keys, exactly as without centering, and adds the mean key alone (the accuracy guide's "Key
    centering" measures both). Without ``center_keys`` both settings change nothing and a warning
    names them (a recipe that centers, run with ``--raw-keys``).
    ``center_seq_len`` takes the mean key over windows of that many tokens (a second pass over the
    same token budget) instead of the recipe's ``seq_len`` windows: RoPE turns the slow channels of
    a post-RoPE key with its position, so the mean of the keys a cache holds depends on how long the
    context is, and a mean over short windows misses what long contexts store. It needs ``center_fit:
    raw`` (a centered fit reads the second moment about the statistics' own mean).
    """

    model: str = "smollm2-135m"
    data: str = "embedded"
    split: str = "train"
    text_field: str = "text"
    tokens: int = 8192
    seq_len: int = 1024
    batch_size: int = 1
    seed: int = 0
    heldout_tokens: int = 512
    heldout_seqs: int = 1
    pilot_tokens: int = 2048
    k_objective: str = "ktk"            # measured: beats qqt on SmolLM2 and Gemma-3 (docs/design/numerics.md)
    v_objective: str = "sst"
    composition: str = "u_h_pbr"
    granularity: str = "head"
    group_size: int | None = None
    bit_budget: float | None = None     # stored bits per element to spend on per-layer group sizes (calibration.budget)
    split_kv: bool = False              # the budget chooses the keys' and the values' group sizes apart
    k_clip: float | None = None
    v_clip: float | None = None
    sink_tokens: int = DEFAULT_SINK
    recent_tokens: int = DEFAULT_RECENT
    dtype: str = "auto"
    device: str = "auto"
    trust_remote_code: bool = False
    checkpoint_every: int = 4
    refine_steps: int = 0               # Cayley refinement of the rotations on held-out rows (0: off)
    refine_lr: float = DEFAULT_REFINE_LR    # its Adam learning rate (numerics.refine)
    logit_correction: float = 0.0       # gain of the logit-noise correction the artifact asks for (0: off)
    center_keys: bool = False           # store every key centered on the calibration's mean key (k_mean)
    center_fit: str = "centered"        # with center_keys: fit on the centered keys, or on the raw ones (CENTER_FITS)
    center_seq_len: int | None = None   # with center_keys: the windows the mean key is taken over (None: seq_len)
    extra: dict = field(default_factory=dict)   # free-form notes carried into the report

    def validate(self) -> "CalibrationConfig":
        choose("--k-objective", self.k_objective, tuple(K_OBJECTIVES))
        choose("--v-objective", self.v_objective, tuple(V_OBJECTIVES))
        choose("--composition", self.composition, COMPOSITIONS)
        choose("--granularity", self.granularity, GRANULARITIES)
        for name in ("tokens", "seq_len", "batch_size", "heldout_tokens", "heldout_seqs", "pilot_tokens",
                     "checkpoint_every"):
            if int(getattr(self, name)) <= 0:
                raise InputError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        check_window(self.sink_tokens, self.recent_tokens)
        if int(self.seed) < 0:
            raise InputError("--seed must be non-negative")
        for name in ("k_clip", "v_clip"):
            if getattr(self, name) is not None:
                check_clip(name[0], getattr(self, name))
        if int(self.refine_steps) < 0:
            raise InputError(f"--refine-steps must be >= 0, got {self.refine_steps}")
        if not (float(self.refine_lr) > 0 and math.isfinite(float(self.refine_lr))):
            raise InputError(f"--refine-lr must be a positive number, got {self.refine_lr}")
        if self.refine_steps and self.granularity == "layer":
            raise InputError("--refine-steps refines each KV head's rotations: it needs --granularity head")
        if self.group_size is not None:
            check_group_size(None, self.group_size, "--group-size")     # head_dim is checked once the model is known
        if self.bit_budget is not None:
            b = float(self.bit_budget)
            if not (math.isfinite(b) and b > 2):
                raise InputError(f"--bit-budget must be a number of bits per element above 2, got {self.bit_budget}")
            if self.group_size is not None:
                raise InputError("--bit-budget chooses every layer's group size: leave out --group-size")
            if self.refine_steps:
                raise InputError("--bit-budget and --refine-steps cannot be combined (the refinement runs at one "
                                 "group size)")
        elif self.split_kv:
            raise InputError("--split-kv splits a bit budget between keys and values: it needs --bit-budget")
        self.logit_correction = check_logit_correction(self.logit_correction)
        if not isinstance(self.center_keys, bool):
            raise InputError(f"center_keys must be true or false, got {self.center_keys!r}")
        choose("--center-fit", self.center_fit, CENTER_FITS)
        if self.center_seq_len is not None:
            if isinstance(self.center_seq_len, bool) or not isinstance(self.center_seq_len, int) or self.center_seq_len < 16:
                raise InputError(f"--center-seq-len must be a number of tokens of at least 16, got {self.center_seq_len!r}")
            if self.center_keys and self.center_fit != "raw":
                raise InputError("--center-seq-len takes the mean key over other windows than the fit's: it needs "
                                 "--center-fit raw")
        unused = [f"--center-fit {self.center_fit}"] * (self.center_fit != "centered") + \
            [f"--center-seq-len {self.center_seq_len}"] * (self.center_seq_len is not None)
        if unused and not self.center_keys:
            warnings.warn(f"{' and '.join(unused)} ignored: the keys are not centered (--center-keys)", OscarWarning,
                          stacklevel=2)
        return self

    @property
    def mean_seq_len(self) -> int | None:
        """The window length of a separate pass for the mean key (``center_seq_len`` when it differs
        from ``seq_len``), or None: the statistics' own mean."""
        return self.center_seq_len if self.center_keys and self.center_seq_len not in (None, self.seq_len) else None

    @property
    def fits_centered_keys(self) -> bool:
        """The rotations, clips and bit budget are fitted on the keys centered on their mean (key
        centering with ``center_fit: centered``); otherwise on the raw keys."""
        return self.center_keys and self.center_fit == "centered"

    def fingerprint_fields(self) -> dict:
        """The fields that change the statistics (a checkpoint is only resumed when they match)."""
        keep = ("model", "data", "split", "text_field", "tokens", "seq_len", "batch_size", "seed",
                "heldout_tokens", "heldout_seqs", "pilot_tokens", "dtype")
        return {k: getattr(self, k) for k in keep}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def parse_clip(text: str | None) -> tuple[float | None, float | None]:
    """``"k=0.96,v=0.92"`` -> (0.96, 0.92); ``"fit"``/None -> (None, None)."""
    if text is None or text.strip() in ("", "fit"):
        return None, None
    out = {"k": None, "v": None}
    for part in text.split(","):
        key, sep, val = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in out:
            raise InputError(f"--clip expects k=RATIO,v=RATIO (or 'fit'), got {text!r}")
        try:
            out[key] = float(val)
        except ValueError:
            raise InputError(f"--clip: {val!r} is not a number") from None
        check_clip(key, out[key])
    return out["k"], out["v"]


def check_known_keys(data: dict, cls, where: str) -> None:
    """Refuse keys of ``data`` that are not fields of the dataclass ``cls``, listing the valid ones."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise InputError(f"{where}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(names))}")


def from_mapping(data: dict, *, where: str = "config") -> CalibrationConfig:
    """Build a config from a mapping; unknown keys are an error that lists the valid ones."""
    check_known_keys(data, CalibrationConfig, where)
    return CalibrationConfig(**data).validate()


# command-line values that mean "not given" (the YAML file's value, else the default, stays)
UNSET_OPTIONS = {"dtype": "auto", "device": "auto", "trust_remote_code": False}

# ``oscar calibrate --quick``: a first try in about a minute on two CPU cores. A quarter of the
# default token budget in half-length sequences, and half the held-out rows the clips are fitted on
# (clip fitting costs the square of their length). What it costs in accuracy is measured in the
# docs/guides/calibrate.md ("--quick"). The verify that follows uses ``eval.verify.QUICK_VERIFY``.
QUICK = {"tokens": 2048, "seq_len": 512, "heldout_tokens": 256}


def config_from_options(config: Path | None, options: dict, *, clip: str | None = None,
                        quick: bool = False) -> CalibrationConfig:
    """The settings of one ``oscar calibrate``: the ``calibration:`` section of the YAML file
    ``config`` (if any), then :data:`QUICK` when ``quick``, overridden by the command-line
    ``options`` that were given (not ``None`` and not the option's own default in
    :data:`UNSET_OPTIONS`), and ``clip`` (``--clip`` text)."""
    values = load_yaml_section(config) if config else {}
    if quick:
        values.update(QUICK)
    values.update({k: v for k, v in options.items() if v is not None and (k not in UNSET_OPTIONS
                                                                          or v != UNSET_OPTIONS[k])})
    if clip is not None:
        values["k_clip"], values["v_clip"] = parse_clip(clip)
    if "trust_remote_code" in values:
        values["trust_remote_code"] = bool(values["trust_remote_code"])
    return from_mapping(values, where=str(config) if config else "options")


def load_yaml_mapping(path: Path) -> dict:
    """A YAML file whose top level is a mapping, or one clear :class:`InputError`."""
    import yaml

    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise InputError(f"cannot read config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise InputError(f"{path}: invalid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(doc, dict):
        raise InputError(f"{path}: expected a mapping at the top level")
    return doc


def load_yaml_section(path: Path, section: str = "calibration") -> dict:
    doc = load_yaml_mapping(path)
    sec = doc.get(section, {}) or {}
    if not isinstance(sec, dict):
        raise InputError(f"{path}: '{section}' must be a mapping")
    return sec


def stable_hash(obj) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()
