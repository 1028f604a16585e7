"""``KVScheme``: how one method stores K/V (rotations, clips, INT2 group size, BF16 sink and window),
and ``SchemeLayer``: one layer of it, the object every cache and simulation builds a layer from.

Shared by the real cache (:mod:`oscar_calib.runtime.cache`), the two accuracy simulations
(:mod:`oscar_calib.runtime.simulated`, a ``Cache``; :mod:`oscar_calib.runtime.simulate`, per query
position for perplexity) and every evaluation method.

Key centering (an artifact with ``k_mean``): every key a cache stores, in the BF16 window and in the
INT2 history alike, is ``(k − μ) @ R_k``. ``q·μ`` is the same for every key a query reads, so softmax
is unchanged; a logit soft-cap (``tanh(s / c)``) is not shift-invariant, so the torch paths add
``q·μ`` back before it. The decode kernel needs nothing: it reads the stored keys as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from ..contract.defaults import (
    DEFAULT_RECENT,
    DEFAULT_SINK,
    check_group_size,
    check_logit_correction,
    check_window,
)
from ..errors import InputError

# whose INT2 arithmetic stores the history: oscar's kernels, the OSCAR SGLang fork's (uniform / Lloyd-Max),
# vLLM's (pull request #46774) or llama.cpp's q2_0 (OSCAR's branch): :mod:`oscar_calib.numerics.engines`
QUANTIZERS = ("oscar", "fork", "fork-lloyd", "vllm", "llamacpp")
ENGINE_QUANTIZERS = ("vllm", "llamacpp")
# the quantisers whose simulations store keys as those engines' code does: uncentered (no k_mean)
UNCENTERED_QUANTIZERS = ("fork", "fork-lloyd", *ENGINE_QUANTIZERS)


def key_shift(k_mean: torch.Tensor | None, k_rotation: torch.Tensor | None) -> torch.Tensor | None:
    """``[H, d]`` float32: the shift every stored key carries in the keys' rotated basis, ``μ @ R_k``
    per KV head (``μ`` without a rotation; computed in float64), or None without a mean ``k_mean``.
    A stored key is ``k @ R_k − key_shift``: the write kernels' ``center`` operand."""
    if k_mean is None:
        return None
    mu = k_mean.to(torch.float64)
    if k_rotation is None:
        return mu.float()
    return torch.einsum("hd,hde->he", mu, k_rotation.to(mu.device, torch.float64)).float()


@dataclass(frozen=True)
class SchemeLayer:
    """One layer of a :class:`KVScheme` (:meth:`KVScheme.layer`): everything a cache layer stores
    K/V by, passed whole to :class:`~oscar_calib.runtime.cache.OscarLayer` and its
    :class:`~oscar_calib.runtime.plan.LayerPlan`, to
    :class:`~oscar_calib.runtime.simulated.SimulatedLayer` and to the simulations of
    :mod:`oscar_calib.runtime.simulate`. A missing rotation is the identity, a missing clip none."""

    k_rotation: torch.Tensor | None = None     # [H, d, d]: keys stored as k @ R_k, queries rotated alike
    k_clip: torch.Tensor | None = None         # [H]: the keys' clip ratios
    v_rotation: torch.Tensor | None = None     # [H, d, d]
    v_clip: torch.Tensor | None = None         # [H]
    groups: tuple[int, int] | None = None      # the keys' and the values' INT2 group sizes (None: not quantised)
    sink: int = DEFAULT_SINK
    recent: int = DEFAULT_RECENT
    window_dtype: torch.dtype | None = torch.bfloat16      # None: the model's dtype
    logit_correction: float = 0.0
    k_mean: torch.Tensor | None = None         # [H, d]: every stored key centered on it (None: not centered)

    @property
    def rotations(self) -> tuple:
        """``(k_rotation, k_clip, v_rotation, v_clip)`` as stored."""
        return self.k_rotation, self.k_clip, self.v_rotation, self.v_clip

    def on(self, device) -> tuple:
        """:attr:`rotations` in float32 on ``device`` (None stays None)."""
        return tuple(None if t is None else t.to(device, torch.float32).contiguous() for t in self.rotations)

    def k_shift(self, device=None) -> torch.Tensor | None:
        """The layer's :func:`key_shift` (float32, on ``device`` when given; None without centering)."""
        shift = key_shift(self.k_mean, self.k_rotation)
        return shift if shift is None or device is None else shift.to(device)

    def mean_on(self, device) -> torch.Tensor | None:
        """``k_mean`` in float32 on ``device`` (None without centering)."""
        return None if self.k_mean is None else self.k_mean.to(device, torch.float32)


@dataclass
class KVScheme:
    """How one method stores K/V: per-layer rotations and clips, INT2 group size, sink, window.

    ``k_rotation[i]``/``v_rotation[i]`` are ``[kv_heads, d, d]`` (``None`` = identity) and
    ``k_clip[i]``/``v_clip[i]`` ``[kv_heads]`` (``None`` = no clip). ``group_size=None`` means no
    INT2 at all (the history stays in ``window_dtype``). ``window_dtype=None`` keeps the model's
    own dtype for the sink and window (no rounding).

    ``quantizer`` says whose INT2 arithmetic stores the history (see :data:`QUANTIZERS`):
    ``oscar`` (our kernels: fp16 scale and offset, ``2 + 32/G`` bits), ``fork`` or ``fork-lloyd``
    (the OSCAR SGLang fork: float32 scale and zero, ``2 + 64/G`` bits, uniform or Lloyd-Max buckets;
    K/V/Q are rotated and held in ``window_dtype`` in the rotated basis as the fork's KV pool does).
    Only :class:`~oscar_calib.runtime.simulate.SimulatedKV` reads the fork's quantisers; the real
    caches store with ``oscar``'s. A subclass may accept other names (:attr:`quantizers`) that it
    registers with :func:`~oscar_calib.runtime.simulate.register_quantizer`
    (:mod:`oscar_calib.experimental`).

    ``vllm`` / ``llamacpp``: those engines' quantisers (:mod:`oscar_calib.numerics.engines`; read
    only by :class:`~oscar_calib.runtime.simulate.SimulatedKV`). ``native_layers``: layers whose
    history is not quantised at all (vLLM keeps its first and last two in the model's dtype).

    ``k_groups[i]``/``v_groups[i]``: the INT2 group size of layer ``i``'s keys and values (a bit
    budget spent unevenly, :mod:`oscar_calib.calibration.budget`); empty = ``group_size`` everywhere.
    ``group_size`` stays the scheme's nominal size (an artifact's uniform ``group_size``). Every
    cache and simulation reads any split (the kernels take a K and a V size per layer).

    ``logit_correction``: the gain ``a`` of the logit-noise correction (0: off), which subtracts
    ``a`` times half the variance of each INT2 key's logit noise from its logit
    (:func:`~oscar_calib.numerics.quant.logit_noise`); oscar's quantiser only. Every cache,
    simulation and kernel of oscar applies it; no other engine does.

    ``k_mean[i]``: layer ``i``'s mean key ``[kv_heads, d]`` (``None``: no key centering); not with
    the other engines' quantisers (:data:`UNCENTERED_QUANTIZERS`). Every cache and simulation of
    oscar stores the keys centered on it (the module docstring). :meth:`layer` gives one layer as a
    :class:`SchemeLayer`.
    """

    name: str
    num_layers: int
    group_size: int | None
    k_rotation: list = field(default_factory=list)
    v_rotation: list = field(default_factory=list)
    k_clip: list = field(default_factory=list)
    v_clip: list = field(default_factory=list)
    sink: int = DEFAULT_SINK
    recent: int = DEFAULT_RECENT
    window_dtype: torch.dtype | None = torch.bfloat16
    # per layer, [kv_heads, d, d] or None: the attention output is mapped back with ``o @ Rᵀ`` although
    # V is stored as the model computes it (an engine that absorbed R_v into the V projection at load
    # time, like the OSCAR SGLang fork with SGLANG_OSCAR_ABSORB_V_ROTATION=1)
    v_output: list = field(default_factory=list)
    quantizer: str = "oscar"
    k_groups: list = field(default_factory=list)
    v_groups: list = field(default_factory=list)
    native_layers: tuple = ()
    logit_correction: float = 0.0
    k_mean: list = field(default_factory=list)

    # the quantizer names this class accepts, and its per-layer list fields (empty: None per layer)
    quantizers: ClassVar[tuple[str, ...]] = QUANTIZERS
    per_layer: ClassVar[tuple[str, ...]] = ("k_rotation", "v_rotation", "k_clip", "v_clip", "v_output", "k_mean")

    def __post_init__(self):
        for name in self.per_layer:
            lst = getattr(self, name)
            if not lst:
                setattr(self, name, [None] * self.num_layers)
            elif len(lst) != self.num_layers:
                raise InputError(f"{self.name}: {name} has {len(lst)} layers, expected {self.num_layers}")
        check_window(self.sink, self.recent)
        self.logit_correction = check_logit_correction(self.logit_correction, f"{self.name}: logit_correction")
        if self.logit_correction and (self.quantizer != "oscar" or self.group_size is None):
            raise InputError(f"{self.name}: the logit-noise correction applies to oscar's INT2 history only")
        if self.centered and (self.quantizer in UNCENTERED_QUANTIZERS or self.group_size is None):
            raise InputError(f"{self.name}: key centering (k_mean) applies to a quantised history stored the oscar "
                             f"way; the {self.quantizer!r} simulation stores the keys as that engine does, uncentered")
        if self.quantizer not in self.quantizers:
            raise InputError(f"{self.name}: unknown quantizer {self.quantizer!r}; choose from "
                             f"{', '.join(self.quantizers)}")
        if self.group_size is not None:
            check_group_size(None, self.group_size)
        for name in ("k_groups", "v_groups"):
            lst = getattr(self, name)
            if lst and self.group_size is None:
                raise InputError(f"{self.name}: {name} given but nothing is quantised (group_size None)")
            if lst and len(lst) != self.num_layers:
                raise InputError(f"{self.name}: {name} has {len(lst)} layers, expected {self.num_layers}")
            for g in lst:
                check_group_size(None, g)
            setattr(self, name, [int(g) for g in lst] if lst else [self.group_size] * self.num_layers)

    @property
    def quantized(self) -> bool:
        return self.group_size is not None

    @property
    def centered(self) -> bool:
        """Some layer stores its keys centered on a mean key (``k_mean``)."""
        return any(m is not None for m in self.k_mean)

    @property
    def bits_per_element(self) -> float:
        """Stored bits per history element: ``2 + 32/G`` (fp16 scale and offset per group; the fork's
        quantisers ``2 + 64/G``, float32 scale and zero), or the window dtype's width when nothing is
        quantised."""
        if self.group_size is None:
            return float(torch.finfo(self.window_dtype).bits) if self.window_dtype else 32.0
        return sum(self.layer_bits(i) for i in range(self.num_layers)) / self.num_layers

    def quantizes(self, i: int) -> bool:
        """Layer ``i``'s history is stored quantised (not a native layer, and the scheme quantises)."""
        return self.quantized and i not in self.native_layers

    def layer_bits(self, i: int) -> float:
        """Stored bits per history element of layer ``i``, K and V averaged (they hold as many)."""
        if not self.quantizes(i):
            return float(torch.finfo(self.window_dtype).bits) if self.window_dtype else 32.0
        if self.quantizer == "llamacpp":
            from ..numerics.engines import Q2_0_BITS

            return Q2_0_BITS
        if self.quantizer == "vllm":
            from ..numerics.engines import VLLM_PARAM_BITS

            return sum(2.0 + VLLM_PARAM_BITS / g for g in self.groups(i)) / 2
        if self.quantizer in ("fork", "fork-lloyd"):
            from ..numerics.quant import FORK_PARAM_BITS

            return sum(2.0 + FORK_PARAM_BITS / g for g in self.groups(i)) / 2
        from ..kernels.pack import bits_per_element

        return sum(bits_per_element(g) for g in self.groups(i)) / 2

    @property
    def uniform_groups(self) -> bool:
        """Every layer's K and V use ``group_size``."""
        return all(g == self.group_size for g in self.k_groups + self.v_groups)

    def groups(self, i: int) -> tuple[int | None, int | None]:
        """``(K, V)`` group sizes of layer ``i`` (None, None when nothing is quantised)."""
        return self.k_groups[i], self.v_groups[i]

    def require_oscar_quantizer(self, cache: str) -> None:
        """Refuse, in one line, a quantiser a real cache cannot store (the fork's float32 and
        Lloyd-Max arithmetic, or an experimental quantiser: perplexity-simulation only)."""
        if self.quantizer != "oscar":
            raise InputError(f"{self.name}: {cache} stores oscar's uniform INT2; the {self.quantizer!r} quantiser "
                             "exists only in the perplexity simulation (SimulatedKV)")

    def layer(self, i: int) -> SchemeLayer:
        """Layer ``i``, whole: its rotations and clips, group sizes, windows, correction and mean key."""
        return SchemeLayer(self.k_rotation[i], self.k_clip[i], self.v_rotation[i], self.v_clip[i],
                           groups=self.groups(i) if self.quantized else None, sink=self.sink, recent=self.recent,
                           window_dtype=self.window_dtype, logit_correction=self.logit_correction,
                           k_mean=self.k_mean[i])

    def reads_window(self, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        """Whether the query at position ``qpos`` reads the key at ``kpos`` from the 16-bit window
        (broadcast, bool): the sink (``kpos < sink``) and its recent window (``qpos − kpos <
        recent``); every older key comes from the quantised history. The perplexity simulation
        asks this for every (query, key) pair; a scheme that lets keys leave the window otherwise
        (e.g. in blocks of tokens) overrides it."""
        return (kpos < self.sink) | (qpos - kpos < self.recent)

    # -- constructors ------------------------------------------------------------------------
    @classmethod
    def full_precision(cls, num_layers: int, *, name: str = "bf16", window_dtype=torch.bfloat16,
                       sink: int = DEFAULT_SINK, recent: int = DEFAULT_RECENT) -> "KVScheme":
        """No INT2: every K/V row in ``window_dtype`` (None: the model's dtype, i.e. lossless)."""
        return cls(name, num_layers, None, sink=sink, recent=recent, window_dtype=window_dtype)

    @classmethod
    def uniform(cls, name: str, num_layers: int, num_kv_heads, head_dim, group_size: int, *,
                rotation: str = "identity", clips: tuple[float, float] = (1.0, 1.0), sink: int = DEFAULT_SINK,
                recent: int = DEFAULT_RECENT, window_dtype=torch.bfloat16) -> "KVScheme":
        """One data-free rotation for every layer: ``identity`` (naive INT2) or ``hadamard``
        (QuaRot-style), with global clip ratios ``(k, v)``. ``num_kv_heads`` / ``head_dim``: one
        number for every layer, or one per layer (layers that differ, e.g. Gemma 4's)."""
        from ..numerics.hadamard import hadamard

        if rotation not in ("identity", "hadamard"):
            raise InputError(f"unknown rotation {rotation!r}; choose identity or hadamard")
        heads = [num_kv_heads] * num_layers if isinstance(num_kv_heads, int) else list(num_kv_heads)
        dims = [head_dim] * num_layers if isinstance(head_dim, int) else list(head_dim)
        cache: dict = {}

        def per_layer(h: int, d: int) -> tuple:
            if (h, d) not in cache:
                r = hadamard(d, warn=False).float().expand(h, -1, -1).contiguous() if rotation == "hadamard" else None
                cache[h, d] = (r, *(None if c >= 1 else torch.full((h,), float(c)) for c in clips))
            return cache[h, d]

        r, ck, cv = zip(*(per_layer(h, d) for h, d in zip(heads, dims))) if num_layers else ((), (), ())
        return cls(name, num_layers, group_size, list(r), list(r), list(ck), list(cv), sink=sink, recent=recent,
                   window_dtype=window_dtype)

    @classmethod
    def from_artifact(cls, artifact, *, name: str = "oscar", group_size: int | None = None, sink: int | None = None,
                      recent: int | None = None, window_dtype=torch.bfloat16,
                      logit_correction: float | None = None) -> "KVScheme":
        """The artifact's rotations and clips; group size, sink, window and logit-noise correction
        default to its metadata (its per-layer K and V sizes, ``layer_group_sizes`` /
        ``layer_v_group_sizes``, when stored; ``group_size`` given: that size everywhere, for K
        and V; ``logit_correction`` given: that gain instead of the artifact's); an artifact with key
        centering gives every layer its ``k_mean``.

        An artifact marked ``v_folded = "true"`` (``oscar fold-weights``) belongs to a checkpoint whose
        ``v_proj`` already outputs ``v @ R_v`` and whose ``o_proj`` takes the output in that basis: V
        is then stored as it comes (no value rotation) and attention outputs stay rotated."""
        from ..contract.artifact import Artifact, load_artifact

        art = artifact if isinstance(artifact, Artifact) else load_artifact(Path(artifact))
        st = art.settings
        k_sizes = [int(group_size)] * art.num_layers if group_size else st.k_groups
        v_sizes = [int(group_size)] * art.num_layers if group_size else st.v_groups
        return cls(
            name, art.num_layers, int(group_size or st.group_size),
            [lr.k_rotation.float() for lr in art.layers],
            [None if st.v_folded else lr.v_rotation.float() for lr in art.layers],
            [lr.k_clip.float() for lr in art.layers], [lr.v_clip.float() for lr in art.layers],
            sink=st.sink_tokens if sink is None else sink, recent=st.recent_tokens if recent is None else recent,
            window_dtype=window_dtype, k_groups=k_sizes, v_groups=v_sizes,
            logit_correction=st.logit_correction if logit_correction is None else logit_correction,
            k_mean=[lr.k_mean.float() for lr in art.layers] if st.key_centering else [])

    @classmethod
    def shared_from_artifact(cls, artifact, *, name: str = "fork", clips: tuple[float, float] | None = None,
                             group_size: int | None = None, sink: int | None = None, recent: int | None = None,
                             absorb_v: bool = False, bf16_rotations: bool = True,
                             window_dtype=torch.bfloat16, quantizer: str = "oscar") -> "KVScheme":
        """What the OSCAR SGLang fork's main serves for this artifact: the layer's shared rotation for
        every KV head, ONE K and ONE V clip ratio for the whole model (``clips``, default the
        artifact's fitted global pair), its group size and windows. ``bf16_rotations`` rounds the
        rotations to bf16 as the fork's KV pool holds them (the query still meets ``Rᵀ`` exactly as the
        fork computes ``(qR)·k̂``). ``absorb_v`` stores V as the model computes it and maps the
        output back (the caller has folded ``R_v`` into the V projection, as the fork does at load).
        ``quantizer``: ``oscar`` stores the history with oscar's fp16 scale/offset (what the real
        caches can hold), ``fork``/``fork-lloyd`` with the fork's float32 arithmetic (see the class
        docstring; ``fork-lloyd`` needs group size = head_dim)."""
        from ..contract.artifact import Artifact, load_artifact
        from ..errors import ArtifactError

        art = artifact if isinstance(artifact, Artifact) else load_artifact(Path(artifact))
        why = fork_unavailable(art, clips_given=clips is not None)
        if why:
            raise ArtifactError(why)
        clips = clips or art.shared_clips()
        st = art.settings
        heads = st.layer_kv_heads
        rot = {}
        for which in ("k", "v"):
            rs = [art.shared_rotation(i, which)[0].float() for i in range(art.num_layers)]
            if bf16_rotations:
                rs = [r.to(torch.bfloat16).float() for r in rs]
            rot[which] = [r.expand(h, -1, -1).contiguous() for r, h in zip(rs, heads)]
        ck, cv = ([None if c >= 1 else torch.full((h,), float(c)) for h in heads] for c in clips)
        n, g = art.num_layers, int(group_size or st.group_size)
        if quantizer == "fork-lloyd" and g != art.head_dim:
            raise InputError(f"{name}: the fork's Lloyd-Max mode needs group size = head_dim ({art.head_dim}), this "
                             f"scheme has {g}; the fork ignores SGLANG_LLOYD_MAX for grouped scales")
        return cls(name, n, g, rot["k"], [None] * n if absorb_v else rot["v"], ck, cv,
                   sink=st.sink_tokens if sink is None else sink, recent=st.recent_tokens if recent is None else recent,
                   window_dtype=window_dtype, v_output=rot["v"] if absorb_v else [], quantizer=quantizer)


    @classmethod
    def engine_from_artifact(cls, artifact, engine: str, *, clips: tuple[float, float] | None = None,
                             sink: int | None = None, recent: int | None = None) -> "KVScheme":
        """What another engine serves for this artifact with ``oscar export --target ENGINE``'s
        settings (:mod:`oscar_calib.numerics.engines` says where each rule comes from): the layer's
        shared rotation (float32) for every KV head and the global clip pair (default the
        artifact's fitted one), and

        * ``vllm``: one INT2 group per head vector (fp16 scale and minimum), no high-precision
          window, the first and last two layers native (the pull request's revision 9195dd08f3);
        * ``llamacpp``: ``q2_0`` with ONE clip ratio (K's) for K and V, the artifact's sink and
          recent window (or the given ones) in F16."""
        from ..contract.artifact import Artifact, load_artifact
        from ..errors import ArtifactError
        from ..numerics.engines import Q2_0_BLOCK, boundary_layers

        art = artifact if isinstance(artifact, Artifact) else load_artifact(Path(artifact))
        why = fork_unavailable(art, clips_given=clips is not None)
        if why:
            raise ArtifactError(why.replace("for the fork", f"for {engine}"))
        k_clip, v_clip = clips or art.shared_clips()
        if art.settings.mixed_heads:
            from ..contract.features import FEATURES

            raise InputError(FEATURES["layer_head_dims"].dropped(art.settings, engine))
        h, n, d = art.num_kv_heads, art.num_layers, art.head_dim
        rot = {w: [art.shared_rotation(i, w)[0].float().expand(h, -1, -1).contiguous() for i in range(n)]
               for w in ("k", "v")}
        st = art.settings
        if engine == "vllm":
            ck, cv = (None if c >= 1 else torch.full((h,), float(c)) for c in (k_clip, v_clip))
            return cls(engine, n, d, rot["k"], rot["v"], [ck] * n, [cv] * n, sink=0, recent=0,
                       quantizer="vllm", native_layers=tuple(boundary_layers(n, hybrid=st.hybrid)))
        if engine == "llamacpp":
            if d % Q2_0_BLOCK:
                raise InputError(f"{engine}: head_dim {d} is not a whole number of q2_0 blocks of {Q2_0_BLOCK}")
            c = None if k_clip >= 1 else torch.full((h,), float(k_clip))
            return cls(engine, n, Q2_0_BLOCK, rot["k"], rot["v"], [c] * n, [c] * n,
                       sink=st.sink_tokens if sink is None else sink,
                       recent=st.recent_tokens if recent is None else recent,
                       window_dtype=torch.float16, quantizer="llamacpp")
        raise InputError(f"unknown engine {engine!r}; choose from {', '.join(ENGINE_QUANTIZERS)}")


def fork_unavailable(artifact, *, clips_given: bool = False) -> str | None:
    """Why the artifact cannot give the fork's scheme (no global clip pair, unless ``clips_given``, or
    no shared per-layer rotations: made before oscar 0.2), or None."""
    if not clips_given and artifact.shared_clips() is None:
        return f"{artifact.path}: no global K/V clip pair for the fork (made before oscar 0.2?); re-run `oscar calibrate`"
    if any(artifact.shared_rotation(i, "k") is None for i in range(artifact.num_layers)):
        return f"{artifact.path}: no shared per-layer rotations for the fork (made before oscar 0.2?); re-run " \
               "`oscar calibrate`"
    return None
