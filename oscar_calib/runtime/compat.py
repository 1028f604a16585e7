"""The transformers versions the runtime supports, and what it reads from a model's config.

:data:`SUPPORTED_TRANSFORMERS` is the range the caches are *tested* on: its lower bound in CI by
``make test-low`` (a venv under ``.make/`` with that exact version), its upper end by the normal
``make test``. :func:`check_transformers` refuses anything else with one line that says so.

:func:`layer_windows` reads the per-layer attention type through transformers' own
``get_layer_types_and_kwargs``, whose return value changed shape inside the range (5.17 returns
the layer kwargs as one dict for all layers, 5.23 as a list with one dict per layer).
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


def text_config(config):
    """The decoder's text config of a model config (multimodal configs nest it)."""
    if hasattr(config, "get_text_config"):
        return config.get_text_config(decoder=True)
    return config


def layer_windows(config) -> list[int | None]:
    """Per decoder layer: ``None`` for full attention, the window size for sliding attention.
    Other layer kinds (chunked, linear, KV-shared) are refused."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    cfg = text_config(config)
    types, kwargs = get_layer_types_and_kwargs(cfg)
    per_layer = kwargs if isinstance(kwargs, (list, tuple)) else [kwargs] * len(types)
    out: list[int | None] = []
    for i, (kind, kw) in enumerate(zip(types, per_layer)):
        if kind == "full_attention":
            out.append(None)
        elif kind == "sliding_attention" and (kw or {}).get("sliding_window"):
            out.append(int(kw["sliding_window"]))
        else:
            raise UnsupportedModelError(f"layer {i} is a {kind!r} layer; the OSCAR caches support full and "
                                        "sliding-window attention only")
    if not out:
        raise UnsupportedModelError("the model config names no attention layers")
    return out
