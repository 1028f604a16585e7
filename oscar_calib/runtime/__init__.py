"""Runtime: OSCAR's 2-bit KV cache inside transformers models.

==========================  =====================  ==============================================
name                        module                 what it is
==========================  =====================  ==============================================
:class:`OscarCache`         :mod:`.cache`          **the real cache**: packed INT2 history written by
                                                   the write kernel, decode steps through the INT2
                                                   decode kernel (``with cache.attach(model):``)
:func:`generate`            :mod:`.generation`     ``generate(model, ids, cache, ...)``: the model's
                                                   ``generate`` with the cache attached, on the
                                                   fastest path that applies
:class:`OscarAttention`     :mod:`.attention`      the registered attention function's route
:class:`DecodeGraph`        :mod:`.graph`          a decode step of the real cache replayed from a
                                                   CUDA graph (no per-kernel host cost)
:func:`graph_decoding`      :mod:`.graph`          ``generate(custom_generate=graph_decoding)``:
                                                   greedy/sampling with the graph
:class:`SimulatedCache`     :mod:`.simulated`      accuracy simulation as a ``Cache`` (de-quantises
                                                   the history for the model's own attention)
:class:`SimulatedKV`        :mod:`.simulate`       accuracy simulation per query position (ppl)
:class:`KVScheme`           :mod:`.scheme`         how a method stores K/V (rotations, clips, G, window)
==========================  =====================  ==============================================

The INT2 kernels themselves live in :mod:`oscar_calib.kernels`. Importing this package does not
import transformers; its names load on first use.
"""

from __future__ import annotations

_EXPORTS = {"KVScheme": ".scheme", "OscarCache": ".cache", "OscarLayer": ".cache", "OscarAttention": ".attention",
            "DecodeGraph": ".graph", "graph_decoding": ".graph", "generate": ".generation",
            "SimulatedCache": ".simulated", "SimulatedLayer": ".simulated", "SimulatedKV": ".simulate",
            "SUPPORTED_TRANSFORMERS": ".compat", "check_transformers": ".compat"}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
