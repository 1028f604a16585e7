"""Typed errors and warnings. The library raises these; the CLI turns each error into one line and
its ``exit_code`` (2; 130 for :class:`Interrupted`), and each :class:`OscarWarning` into one line
``warning: ...``."""

from __future__ import annotations


class OscarError(Exception):
    """Base class of every error the toolkit reports to a user."""

    exit_code = 2


class InputError(OscarError):
    """Bad user input: a path, an option value, a data file."""


class ModelLoadError(OscarError):
    """A model could not be found, downloaded or loaded."""


class UnsupportedModelError(OscarError):
    """The architecture is known not to fit OSCAR's assumptions (MLA, no KV heads, ...)."""


class DataError(OscarError):
    """Calibration data is missing, empty or too short."""


class NumericalError(OscarError):
    """NaN/Inf activations or statistics; the message names the layer."""


class ArtifactError(OscarError):
    """An artifact is missing, malformed, or does not match the model."""


class OutputExistsError(OscarError):
    """The output location already holds something we would overwrite."""


class EvalError(OscarError):
    """An evaluation cannot run as asked."""


class DistributedError(OscarError):
    """Ranks disagree, a rank failed, or a collective could not complete."""


class WriteError(OscarError):
    """An output could not be written (disk full, quota, read-only or vanished directory); what was
    there before is intact and nothing half-written is left."""


class Interrupted(OscarError):
    """The user interrupted a run (Ctrl-C); the message says what was kept and how to go on."""

    exit_code = 130


class OscarWarning(UserWarning):
    """Something the run can go on with but the user should know (the CLI prints one line
    ``warning: ...``)."""


class PublishError(OscarError):
    """A hub refused or failed a request; the message names the hub and the next step."""


class CacheError(OscarError):
    """A KV cache cannot do what was asked (used without its attention function, cropped past what
    it can restore exactly)."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty): what a
    one-line error quotes from a library's exception."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
