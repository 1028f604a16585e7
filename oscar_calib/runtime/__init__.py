"""Runtime: how a method stores K/V (:class:`~.scheme.KVScheme`), the transformers cache
(:class:`~.cache.OscarCache`) and the perplexity simulation (:class:`~.simulate.SimulatedKV`).
The INT2 kernels themselves live in :mod:`oscar_calib.kernels`.

Importing this package does not import transformers; its names load on first use.
"""

from __future__ import annotations

_EXPORTS = {"KVScheme": ".scheme", "OscarCache": ".cache", "OscarLayer": ".cache", "SimulatedKV": ".simulate"}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
