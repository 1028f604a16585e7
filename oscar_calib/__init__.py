"""oscar: offline calibration of OSCAR rotations for 2-bit KV caches.

Importing this package never initialises CUDA and never imports transformers or triton;
those load lazily in the modules that need them.
"""

__version__ = "0.1.0"

FORMAT_VERSION = 1
