"""oscar: offline calibration of OSCAR rotations for 2-bit KV caches.

Importing this package never initialises CUDA and never imports transformers or triton;
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
