"""Backend selection, input validation and lazy Triton loading shared by the kernels.

Backends
--------
Every public kernel function takes ``backend="auto" | "triton" | "torch"``:

* ``"torch"``: the eager pure-torch reference that lives beside the kernel (any device).
* ``"triton"``: the Triton kernel. Needs CUDA tensors, or ``TRITON_INTERPRET=1`` (CPU tensors,
  slow; what the tests use).
* ``"auto"``: Triton when every tensor is on CUDA, Triton imports and the shape is one the
  kernel supports; the reference otherwise.

triton is a Linux-only dependency (it has no wheels elsewhere): without it ``"auto"`` runs the
references on every device, and ``"triton"`` is refused in one line (:class:`InputError`).

The environment variable ``OSCAR_KERNELS`` overrides the argument: ``torch`` forces the eager
reference everywhere, ``triton`` forces the kernels, ``auto`` (or unset) respects the argument.
"""

from __future__ import annotations

import importlib
import os
import weakref
from functools import lru_cache
from types import ModuleType

import torch

from ..contract.defaults import check_group_size, is_power_of_two
from ..errors import InputError
from ..versions import version_tuple

BACKENDS = ("auto", "triton", "torch")
ENV_VAR = "OSCAR_KERNELS"

FP16_MAX = 65504.0
# Codes are fed to the tensor cores as fp16 *subnormals* (bit pattern == code): value = code * 2**-24.
SUBNORMAL_UNIT = 2.0**-24
INV_SUBNORMAL_UNIT = 2.0**24

_triton_modules: dict[str, ModuleType] = {}
# Tensors derived from an argument tensor (a rotation's 16-bit split or float32 copy, clip
# indices), reused while the source tensor is alive and unmodified (weak reference + version
# counter), so a call per decode step launches only the kernels themselves.
_DERIVED: dict[tuple, tuple] = {}


def interpreting() -> bool:
    """True when Triton runs under its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available() -> bool:
    """Whether the triton package imports here (it is installed on Linux only)."""
    try:
        importlib.import_module("triton")
    except Exception:
        return False
    return True


# head_dim each Triton kernel takes: powers of two in these ranges (the torch references take any multiple of 4); the
# decode-step write (append) takes the write kernel's. A layer outside them (Gemma 4's 512-wide global layers) runs
# the torch reference under backend "auto"; "triton" refuses it
KERNEL_HEAD_DIMS = {"write": (16, 256), "decode": (64, 256)}


def head_dim_problem(d: int, kernel: str) -> str | None:
    """Why the Triton ``kernel`` (``"write"`` or ``"decode"``) does not take head_dim ``d`` (None: it
    does): the one rule :func:`resolve_backend`'s callers and the real cache ask."""
    lo, hi = KERNEL_HEAD_DIMS[kernel]
    if not is_power_of_two(d) or not lo <= d <= hi:
        return f"head_dim {d} (the {kernel} kernel needs a power of two in {lo}..{hi})"
    return None


def resolve_backend(backend: str, tensors: list[torch.Tensor], supported: str | None = None) -> str:
    """Return ``"triton"`` or ``"torch"`` for the given request.

    ``supported`` is None when the Triton kernel handles these shapes, otherwise a sentence
    saying why not (``"auto"`` then falls back to torch, ``"triton"`` raises it).
    """
    if backend not in BACKENDS:
        raise InputError(f"unknown kernel backend {backend!r}; valid: {', '.join(BACKENDS)}")
    env = os.environ.get(ENV_VAR, "").strip().lower()
    if env and env not in BACKENDS:
        raise InputError(f"{ENV_VAR}={env!r} is not valid; use one of {', '.join(BACKENDS)}")
    if env in ("torch", "triton"):
        backend = env
    if backend == "torch":
        return "torch"
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "auto":
        if on_cuda and supported is None and triton_available():
            return "triton"
        return "torch"
    # explicit triton
    if supported is not None:
        raise InputError(f"the Triton kernel does not support this input: {supported}")
    if not triton_available():
        raise InputError("backend='triton' needs the triton package, which is not installed (it has wheels "
                         "for Linux only); use backend='auto' or 'torch'")
    if not on_cuda and not interpreting():
        raise InputError(
            "backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 to run Triton on the CPU)"
        )
    return "triton"


def interpreter_problem() -> str | None:
    """Why the Triton CPU interpreter cannot run our kernels here, or None. Measured: Triton
    3.6's interpreter turns loaded scalars into one-element arrays, which NumPy 2.4 refuses as
    loop bounds (3.6 with NumPy 2.2/2.3 and 3.7-3.9 with NumPy 2.4 pass the kernel tests)."""
    try:
        import numpy
        import triton
    except Exception:  # pragma: no cover - depends on the install
        return None
    if version_tuple(triton.__version__) < (3, 7) and version_tuple(numpy.__version__) >= (2, 4):
        return (f"the Triton {triton.__version__} CPU interpreter cannot run these kernels with NumPy "
                f"{numpy.__version__}; install numpy<2.4 or triton>=3.7 (GPU runs are not affected)")
    return None


def load_triton_module(name: str) -> ModuleType:
    """Import ``oscar_calib.kernels.<name>`` (a module that defines ``@triton.jit`` kernels) lazily."""
    if interpreting():
        why = interpreter_problem()
        if why:
            raise InputError(why)
    mod = _triton_modules.get(name)
    if mod is None:
        mod = importlib.import_module(f"{__package__}.{name}")
        _triton_modules[name] = mod
    return mod


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached per device index)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pdl_capable(device: torch.device) -> bool:
    """Whether kernels on ``device`` can use programmatic dependent launch (a CUDA device of
    compute capability 9 or later, not the interpreter)."""
    if device.type != "cuda" or interpreting():
        return False
    return _major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


@lru_cache(maxsize=None)
def _major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    shape: dict[int, int] | None = None,
) -> torch.Tensor:
    """Validate a tensor argument; raise :class:`InputError` with a message naming it."""
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.ndim != ndim:
        raise InputError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise InputError(f"{name} must have dtype {names}; got {str(t.dtype).replace('torch.', '')}")
    if shape:
        for axis, size in shape.items():
            if t.shape[axis] != size:
                raise InputError(
                    f"{name} has size {t.shape[axis]} on axis {axis} (shape {tuple(t.shape)}), "
                    f"expected {size}"
                )
    return t


def check_group(head_dim: int, group_size: int) -> None:
    """Group-size rules shared by every kernel: :func:`~oscar_calib.contract.defaults.check_group_size`
    plus a head_dim that packs into whole bytes."""
    check_group_size(head_dim, group_size)
    if head_dim % 4:
        raise InputError(f"head_dim {head_dim} is not a multiple of 4 (four 2-bit codes per byte)")


def same_device(*named: tuple[str, torch.Tensor]) -> None:
    devs = {t.device for _, t in named}
    if len(devs) > 1:
        desc = ", ".join(f"{n} on {t.device}" for n, t in named)
        raise InputError(f"tensors must be on one device: {desc}")


def derived(src: torch.Tensor, tag: tuple, make):
    """``make()``, cached for ``src`` (same object, same version) and ``tag``."""
    key = (id(src),) + tag
    hit = _DERIVED.get(key)
    if hit is not None and hit[0]() is src and hit[1] == src._version:
        return hit[2]
    if len(_DERIVED) > 64:
        for k in [k for k, v in _DERIVED.items() if v[0]() is None]:
            del _DERIVED[k]
        if len(_DERIVED) > 64:
            _DERIVED.clear()
    val = make()
    _DERIVED[key] = (weakref.ref(src), src._version, val)
    return val
