"""Kernel tests: run Triton under its CPU interpreter when no GPU is present.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` function is created; the kernel
modules are imported lazily on first use, so setting it here (at conftest import) is early
enough. With a GPU the real compiler runs on CUDA tensors.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

try:  # the package may not be installed in the environment running the tests
    import oscar_calib  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ON_GPU = torch.cuda.is_available()


@pytest.fixture
def device() -> str:
    return "cuda" if ON_GPU else "cpu"


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    monkeypatch.delenv("OSCAR_KERNELS", raising=False)
