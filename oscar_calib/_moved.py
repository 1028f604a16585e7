"""Old module paths (before the package was arranged by stage) keep importing, with a warning.

``import oscar_calib.oscar_cache`` returns :mod:`oscar_calib.runtime.cache` and warns once with
:class:`DeprecationWarning`. Modules that were split list every new home, searched in order for
attribute access (``from oscar_calib.evaluate import run_eval``). Remove in 0.3.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

MOVED = {
    "artifact": ("spec.artifact", "spec.layout", "spec.checks", "fsutil"),
    "card": ("spec.card",),
    "config": ("spec.config", "spec.defaults"),
    "hadamard": ("numerics.hadamard", "spec.defaults"),
    "rotation": ("numerics.rotation",),
    "quant": ("numerics.quant", "spec.defaults"),
    "clip": ("numerics.clip", "spec.defaults"),
    "models": ("model.load", "model.geometry"),
    "registry": ("model.registry",),
    "geometry_configs": ("model.configs",),
    "capture": ("model.capture",),
    "corpus": ("calibrate.corpus",),
    "stats": ("calibrate.stats",),
    "pipeline": ("calibrate.pipeline", "calibrate.report", "calibrate.launch", "calibrate.checkpoint",
                 "model.load"),
    "distributed": ("calibrate.parallel", "calibrate.ranks", "calibrate.launch", "model.placement", "errors"),
    "oscar_cache": ("runtime.cache", "runtime.scheme", "spec.defaults"),
    "evaluate": ("eval", "eval.methods", "eval.ppl", "eval.niah", "eval.report", "runtime.simulate", "errors"),
    "verify": ("tools.verify",),
    "fold": ("tools.fold",),
    "interop": ("tools.export", "tools.export.sglang", "fsutil"),
    "validate": ("tools.validate", "spec.checks", "spec.values", "spec.layout", "spec.stfile"),
    "publish": ("tools.publish", "errors"),
    "zoo": ("tools.zoo",),
}


class _Alias(types.ModuleType):
    """Looks attributes up in the new homes, in order."""

    def __init__(self, name: str, homes: tuple[str, ...]):
        super().__init__(name)
        self.__homes = homes

    def __getattr__(self, attr: str):
        for home in self.__homes:
            mod = importlib.import_module(f"{__package__}.{home}")
            if hasattr(mod, attr):
                return getattr(mod, attr)
        raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        pkg, _, leaf = fullname.rpartition(".")
        if pkg == __package__ and leaf in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        leaf = spec.name.rpartition(".")[2]
        homes = MOVED[leaf]
        warnings.warn(f"{spec.name} moved to {__package__}.{homes[0]}; the old path goes away in 0.3",
                      DeprecationWarning, stacklevel=3)
        return _Alias(spec.name, homes)

    def exec_module(self, module):
        return None


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
