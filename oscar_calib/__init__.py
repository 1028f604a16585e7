"""oscar: offline calibration of OSCAR rotations for 2-bit KV caches.

The public API, one name per step a user takes (each loads its module on first use):

============================  ======================================================================
name                          what it does
============================  ======================================================================
:func:`load_model`            load a model as every oscar tool does (alias, checkpoint, ``.gguf``, hub id)
:class:`CalibrationConfig`    the settings of a calibration, validated once
:func:`calibrate`             calibrate rotations and clips and write an artifact
:func:`load_artifact`         read an artifact, refused unless every check passes
:func:`verify_artifact`       the INT2 kernels on held-out activations against a Hadamard baseline
:func:`run_eval`              held-out perplexity or needle retrieval per KV-cache method
:class:`EvalOptions`          the settings of an evaluation
:class:`OscarCache`           the real 2-bit KV cache inside a transformers model
:func:`generate`              the model's ``generate`` with an ``OscarCache``, on the fastest path
:class:`KVScheme`             how a method stores K/V (rotations, clips, group size, windows)
:func:`export_artifact`       the artifact as an engine loads it (SGLang, vLLM, llama.cpp, ...)
:func:`show_progress`         draw the library's progress reports on stderr, as the CLI does
============================  ======================================================================

Importing this package never initialises CUDA and never imports torch, transformers or triton;
those load lazily in the modules that need them. Imported before torch, it makes idle OpenMP
threads sleep rather than spin (``OMP_WAIT_POLICY=PASSIVE`` unless set; see below).
"""

import os as _os
import sys as _sys

# Idle OpenMP threads sleep instead of spinning, set before torch loads its OpenMP runtime (an
# explicit setting wins; once torch is imported it is too late and nothing is changed). On a busy
# or shared machine spinning threads burn the cores the work needs: measured on 2 cores at load
# 4-6, `oscar calibrate --quick` took 110-266 s and 73-150 s of CPU spinning, 45-50 s and 21 s
# sleeping (docs/guides/calibrate.md), and the README's 2-bit generate 135 s against 25-34 s.
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

FORMAT_VERSION = 1

# name -> the module that defines it, imported on first use (PEP 562)
_API = {
    "load_model": "oscar_calib.model.load",
    "CalibrationConfig": "oscar_calib.contract.config",
    "calibrate": "oscar_calib.calibration.pipeline",
    "load_artifact": "oscar_calib.contract.artifact",
    "verify_artifact": "oscar_calib.eval.verify",
    "run_eval": "oscar_calib.eval",
    "EvalOptions": "oscar_calib.eval.options",
    "OscarCache": "oscar_calib.runtime.cache",
    "generate": "oscar_calib.runtime.generation",
    "KVScheme": "oscar_calib.runtime.scheme",
    "export_artifact": "oscar_calib.tools.export",
    "show_progress": "oscar_calib.display",
}


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])


__all__ = ["FORMAT_VERSION", "__version__", *_API]
