"""The transformers versions the runtime supports, and what it reads from a model's config.

:data:`SUPPORTED_TRANSFORMERS` is the range the caches are *tested* on: its lower bound in CI by
``make test-low`` (a venv under ``.make/`` with that exact version), its upper end by the normal
``make test``. :func:`check_transformers` refuses anything else with one line that says so.

:func:`layer_windows` reads the per-layer attention type through transformers' own
``get_layer_types_and_kwargs`` (:func:`oscar_calib.model.geometry.layer_kinds`, which also
evens out the shape of its return value inside the range).
"""

from __future__ import annotations

from ..errors import UnsupportedModelError
from ..versions import version_tuple

SUPPORTED_TRANSFORMERS = (">=5.17", "<5.24")
_LOW, _HIGH = (5, 17), (5, 24)          # inclusive, exclusive (major, minor)


def check_transformers(version: str | None = None) -> None:
    """Raise :class:`UnsupportedModelError` unless ``version`` (default: the installed one) lies
    in :data:`SUPPORTED_TRANSFORMERS`."""
    if version is None:
        import transformers

        version = transformers.__version__
    if not _LOW <= version_tuple(version) < _HIGH:
        raise UnsupportedModelError(
            f"the OSCAR caches are tested with transformers {','.join(SUPPORTED_TRANSFORMERS)} "
            f"(5.17 and 5.23 in CI); found {version}: install a version in that range")


def layer_windows(config) -> list[tuple[int | None, int | None]]:
    """Per decoder layer ``(window, chunk)`` (the layer kinds of
    :func:`~oscar_calib.model.geometry.layer_kinds`, transformers' own reading): ``(None, None)``
    for full attention, ``(W, None)`` for a sliding window of ``W`` tokens, ``(C, C)`` for chunked
    attention in chunks of ``C`` (Llama 4: a query reads the tokens of its own chunk, never more
    than ``C``, so the layer keeps a window of ``C`` as transformers' own caches do). Other layer
    kinds (linear, recurrent, KV-shared) are refused."""
    from ..model.geometry import layer_kinds, text_config

    out: list[tuple[int | None, int | None]] = []
    for i, (kind, kw) in enumerate(layer_kinds(text_config(config))):
        w = kw.get("sliding_window")
        if kind == "full_attention":
            out.append((None, None))
        elif kind in ("sliding_attention", "chunked_attention") and w:
            out.append((int(w), int(w) if kind == "chunked_attention" else None))
        else:
            raise UnsupportedModelError(f"layer {i} is a {kind!r} layer; the OSCAR caches support full, "
                                        "sliding-window and chunked attention only")
    if not out:
        raise UnsupportedModelError("the model config names no attention layers")
    return out
