"""``SimulatedKV``: attention that reads K/V as a :class:`~oscar_calib.runtime.scheme.KVScheme`
stores them, per query position (an accuracy tool, not a cache).

For every query position ``i``, key/value ``j`` is read in BF16 when ``j < sink`` or
``i − j < recent`` and as INT2 (rotated, clipped, quantised, stored with fp16 scale/offset
exactly as :mod:`oscar_calib.kernels` stores it) otherwise. The BF16 rows are read as
:class:`~oscar_calib.runtime.cache.OscarCache`'s window holds them: it stores them in the rotated
basis, rounded to BF16 a second time after the rotation (:func:`window_rows`); a simulation
that read them as the model computed them scored Gemma-3-270M's zoo artifact 0.08% better than the
real cache at 512 tokens (20.606 against 20.623, CPU, float32 weights), and tiny models' logits
differed by up to 3e-2. Positions below ``prefill`` attend at full precision (a serving engine's
prefill of a prompt; the first token always: a cache starts empty). One forward pass per sequence through
an attention function registered with transformers' ``AttentionInterface``; the model's causal and
sliding-window masks and GQA are honoured, math is float32. With nothing quantised it equals
plain attention (tested). It de-quantises every key for every layer: memory and time grow with
the context like a full-precision cache, so it measures accuracy only.

A scheme with a ``logit_correction`` subtracts it from the logit of every INT2 key
(:func:`logit_noise_rows`), as the real cache and the decode kernel do. Attention sinks (gpt-oss's
``s_aux``, a learned logit per query head) join every softmax as one more key of value zero, as
the model's own attention adds them. A scheme with key centering (``k_mean``) quantises the INT2
keys centered and reads them back in the model's basis (:func:`oscar_rows`), which is the real
cache's softmax, soft-capped, with sinks or not.

A scheme whose ``quantizer`` is ``vllm`` or ``llamacpp`` is read as those engines store it
(:func:`vllm_rows`, :func:`llamacpp_rows`; the same per-query-position simplifications as the fork's).

A scheme whose ``quantizer`` is ``fork`` or ``fork-lloyd`` is read the way the OSCAR SGLang fork's
main stores it (:func:`fork_rows`): query, keys and values rotated in BF16 as its KV pool holds
them, the history clipped and quantised with its float32 scale and zero (or its Lloyd-Max buckets),
the output mapped back with ``o @ R_vᵀ`` in BF16. What it does not model, by design: every query
position reads its own window exactly as a decode step does (the fork's prefill reads the prompt's
own chunk in full precision), the recent window is exactly ``recent`` tokens (the fork's slides
between R and R+7 during decode, demoting 8 tokens at a time), and every INT2 token is clipped
with the sorted-threshold rule of the fork's prefill kernel (the tokens its decode flush demotes
get a bisection threshold that clips about one element more per row, and never Lloyd-Max).
"""

from __future__ import annotations

import math

import torch

from ..errors import EvalError
from ..model.capture import AttentionRoute, attention_slot, attention_slots, call_window
from .attend import allowed_mask
from .scheme import QUANTIZERS, KVScheme, key_shift

SIM_NAME = "oscar_kv_sim"


_ACTIVE: list["SimulatedKV"] = []


def _sim_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, s_aux=None,
                   **kwargs):
    sim = _ACTIVE[-1]
    layer = attention_slot(sim.slots, module)          # the scheme's layer (a hybrid model's attention layers)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = sim.attend(layer, query, key, value, attention_mask, scale, call_window(module, kwargs), softcap,
                     **({} if s_aux is None else {"sinks": s_aux}))
    return out.to(query.dtype), None


class SimulatedKV(AttentionRoute):
    """Route a model's attention through :meth:`attend`, which reads K/V as ``scheme`` stores
    them (per query position: sink and recent window in BF16, the rest INT2). Sets and restores
    the attention implementation of every config of the model, also on error. ``prefill``: the
    query positions below it attend at full precision to the keys as the model computed them,
    as :class:`~oscar_calib.runtime.cache.OscarCache` attends during a prefill; the later ones
    read the cache as a decode step does.

    >>> with SimulatedKV(model, scheme):
    ...     logits = model(ids).logits
    """

    name = SIM_NAME
    active = _ACTIVE

    def __init__(self, model, scheme: KVScheme, *, prefill: int = 0):
        if not isinstance(prefill, int) or isinstance(prefill, bool) or prefill < 0:
            raise ValueError(f"prefill must be a non-negative integer, got {prefill!r}")
        self.model, self.scheme, self.prefill = model, scheme, prefill
        self.row_elements = ROW_BLOCK_ELEMENTS        # scores per block of query rows (see attend)

    def __enter__(self) -> "SimulatedKV":
        from transformers import AttentionInterface

        AttentionInterface.register(SIM_NAME, _sim_attention)
        self.slots = attention_slots(self.model)
        return self._route("sdpa")

    @staticmethod
    def _allowed(mask, b: int, t: int, s: int, window: int | None, device, qpos: torch.Tensor) -> torch.Tensor:
        """Boolean [B|1, 1, T, S]: the model's mask, or causal (+ sliding window) when it is None
        (``qpos [T, 1]``: the query rows' positions)."""
        if mask is None:
            kpos = torch.arange(s, device=device).unsqueeze(0)
            m = kpos <= qpos
            if window:
                m &= qpos - kpos < window
            return m.view(1, 1, t, s)
        return allowed_mask(mask[..., -s:])

    def attend(self, layer: int, q, k, v, mask, scaling: float, window: int | None, softcap,
               positions=None, sinks=None) -> torch.Tensor:
        """q [B, Hq, T, d], k/v [B, Hkv, S, d] -> attention output [B, T, Hq, d] (float32).
        ``positions``: the query rows' positions among the keys (a sequence of ``T`` ints; default
        the last ``T``), with ``mask`` None: row ``i`` reads the keys up to its position.
        ``sinks [Hq]``: attention-sink logits, one more key per query head of value zero (gpt-oss).

        Exact per-(i, j) selection with one attention call per block of query rows: the keys are
        the INT2 version followed by the window version (oscar's quantiser: the INT2 keys rotated
        back, ``K̂Rᵀ``, so ``q·(K̂Rᵀ)ᵀ = (qR)·K̂ᵀ``, and the window rows as the real cache's window
        holds them, :func:`window_rows`; the fork's: everything in the rotated basis, see
        :func:`fork_rows`), values likewise, and the mask lets row ``i`` read column ``j`` of the
        window half when :meth:`~oscar_calib.runtime.scheme.KVScheme.reads_window` says so
        (``j < sink`` or ``i − j < recent``) and of the INT2 half otherwise (both within the
        model's own mask). The softmax over the ``2S`` columns is then the softmax over the ``S``
        keys each read in the right precision, and ``P·V`` sums each part. Rows at positions below
        ``prefill`` read every key as the model computed it (plain attention). Query rows are taken
        ``row_elements`` scores at a time (:data:`ROW_BLOCK_ELEMENTS`), so the temporaries stay
        bounded at long contexts."""
        sch = self.scheme
        b, hq, t, d = q.shape
        hkv, s = k.shape[1], k.shape[2]
        grp = hq // hkv
        if positions is not None and mask is not None:
            raise ValueError("attend(positions=...) takes no mask")
        qpos = (torch.arange(t, device=q.device) + (s - t) if positions is None
                else torch.as_tensor(positions, device=q.device)).unsqueeze(1)                   # [T, 1]
        allowed = self._allowed(mask, b, t, s, window, q.device, qpos)                    # [B|1, 1, T, S]
        rows = ROWS.get(sch.quantizer)
        if rows is None:
            raise EvalError(f"{sch.name}: no simulation of the {sch.quantizer!r} quantiser; registered: "
                            f"{', '.join(ROWS)}")
        pre = (qpos[:, 0] < self.prefill).nonzero().squeeze(1)
        post = (qpos[:, 0] >= self.prefill).nonzero().squeeze(1)
        out = torch.empty(b, hq, t, d, device=q.device)
        step = max(1, self.row_elements // max(1, b * hq * 2 * s))
        if len(pre):                        # a full-precision prefill: the model's own K/V
            qf, kf, vf = q.float(), k.float().repeat_interleave(grp, 1), v.float().repeat_interleave(grp, 1)
            for a in range(0, len(pre), step):
                r = pre[a:a + step]
                out[:, :, r] = _scores_softmax(qf[:, :, r], kf, vf, allowed[..., r, :], scaling, softcap, sinks=sinks)
        if not len(post):
            return out.transpose(1, 2)
        qf, keys, values, k_lo, v_lo, back, *engine = rows(sch, layer, q, k, v)
        q_lo, hp_weights = engine if engine else (None, None)
        if k_lo is not None and layer in sch.native_layers:
            k_lo = v_lo = None
        if k_lo is not None:
            keys = torch.cat([k_lo, keys], dim=2)
            values = torch.cat([v_lo, values], dim=2)
        keys, values = keys.repeat_interleave(grp, 1), values.repeat_interleave(grp, 1)
        scales = key_scales(sch, layer, k) if sch.logit_correction and k_lo is not None else None
        kpos = torch.arange(s, device=q.device).unsqueeze(0)
        for a in range(0, len(post), step):
            r = post[a:a + step]
            ok = allowed[..., r, :]
            noise = None
            if k_lo is not None:
                hi = sch.reads_window(qpos[r], kpos)                                           # [Tb, S]
                ok = torch.cat([ok & ~hi, ok & hi], dim=-1)                                    # [B|1, 1, Tb, 2S]
                if scales is not None:                               # over the INT2 half only
                    noise = logit_noise_of(sch, layer, q[:, :, r], scales, scaling)
                    noise = torch.cat([noise, torch.zeros_like(noise)], dim=-1)                # [B, Hq, Tb, 2S]
            o = _scores_softmax(qf[:, :, r], keys, values, ok, scaling, softcap, noise,
                                None if q_lo is None or k_lo is None else q_lo[:, :, r],
                                hp_weights if k_lo is not None else None, sinks)
            out[:, :, r] = back(o) if back is not None else o
        return out.transpose(1, 2)


# query rows x keys scored at once by SimulatedKV.attend (64 Mi scores: 256 MiB of float32 per temporary)
ROW_BLOCK_ELEMENTS = 1 << 26


def _scores_softmax(qf, keys, values, allowed, scaling: float, softcap, noise=None, q_lo=None, hp_weights=None,
                    sinks=None):
    """``softmax(q·kᵀ · scaling − noise) · v`` over the keys ``allowed`` lets each row read:
    ``qf [B, Hq, T, d]``, ``keys``/``values`` ``[B, Hq, K, d]``, ``allowed [B|1, 1, T, K]`` bool,
    ``noise`` None or ``[B, Hq, T, K]``. With ``q_lo`` (an engine's low-precision query) the first
    ``K/2`` keys (the INT2 half) are scored with it; ``hp_weights``: the dtype the weights of the
    second half are rounded to before they meet its values (see :func:`llamacpp_rows`); ``sinks
    [Hq]``: attention-sink logits, one more column per query head whose value is zero (gpt-oss)."""
    hq = qf.shape[1]
    if not softcap and q_lo is None and sinks is None:
        mask = allowed if noise is None else (-noise).masked_fill(~allowed, -math.inf)
        return torch.nn.functional.scaled_dot_product_attention(qf, keys, values, attn_mask=mask, scale=scaling)
    half = keys.shape[2] // 2
    if q_lo is not None:
        sc = torch.cat([q_lo @ keys[:, :, :half].transpose(-1, -2), qf @ keys[:, :, half:].transpose(-1, -2)], -1)
    else:
        sc = qf @ keys.transpose(-1, -2)
    sc = sc * scaling
    if softcap:
        sc = torch.tanh(sc / softcap) * softcap
    if noise is not None:
        sc = sc - noise
    sc = sc.masked_fill(~allowed, -math.inf)
    if sinks is not None:           # the sink column joins the softmax, then leaves (its value is zero)
        sc = torch.cat([sc, sinks.float().view(1, hq, 1, 1).expand(*sc.shape[:-1], 1)], dim=-1)
    p = torch.softmax(sc, dim=-1)
    if sinks is not None:
        p = p[..., :-1]
    if hp_weights is not None:
        p = torch.cat([p[..., :half], _round(p[..., half:], hp_weights)], -1)
    return p @ values


def key_scales(sch: KVScheme, layer: int, k) -> torch.Tensor:
    """The fp16 group scales ``[B, Hkv, S, d/G_K]`` oscar stores for every key of ``k [B, Hkv, S, d]``
    (rounded to the window dtype first, as the cache quantises it; centered with key centering)."""
    from ..kernels import quantize_kv

    ls = sch.layer(layer)
    rk, ck = ls.on(k.device)[:2]
    k_in = k.to(sch.window_dtype) if sch.window_dtype is not None else k
    return quantize_kv(k_in.transpose(1, 2), rk, ck, sch.groups(layer)[0],
                       center=ls.k_shift(k.device)).scale.permute(0, 2, 1, 3)


def logit_noise_of(sch: KVScheme, layer: int, q, scales: torch.Tensor, scaling: float) -> torch.Tensor:
    """The logit-noise correction ``[B, Hq, T, S]`` of queries ``q [B, Hq, T, d]`` against keys with
    stored scales ``scales`` (:func:`key_scales`): :func:`~oscar_calib.numerics.quant.logit_noise` with
    the query in the keys' rotated basis."""
    from ..numerics.quant import logit_noise

    rk = sch.layer(layer).k_rotation
    grp = q.shape[1] // scales.shape[1]
    qr = q.float() if rk is None else torch.einsum("bhtd,hde->bhte", q.float(),
                                                   rk.to(q.device, torch.float32).repeat_interleave(grp, 0))
    return logit_noise(qr, scales.repeat_interleave(grp, 1), sch.groups(layer)[0], sch.logit_correction, scaling)


def logit_noise_rows(sch: KVScheme, layer: int, q, k, scaling: float) -> torch.Tensor:
    """The logit-noise correction ``[B, Hq, T, S]`` of every query and every key of ``k`` as oscar
    stores it in INT2 (:func:`key_scales`, then :func:`logit_noise_of`)."""
    return logit_noise_of(sch, layer, q, key_scales(sch, layer, k), scaling)


def output_unrotation(r: torch.Tensor, grp: int, dtype=None):
    """``o -> o @ Rᵀ`` per query head (``r`` [Hkv, d, d], query head j reads KV head j // grp), with
    operands and result rounded to ``dtype`` when given (a 16-bit GEMM with fp32 accumulation)."""
    rq = _round(r.repeat_interleave(grp, 0), dtype)

    def back(o):
        return _round(torch.einsum("bhtd,hed->bhte", _round(o, dtype), rq), dtype)

    return back


def _round(x: torch.Tensor, dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` and back to float32 (None: unchanged, as float32)."""
    return x.float() if dtype is None else x.to(dtype).float()


def kernel_store(x: torch.Tensor, rotation, clip, group_size: int, cache: str, center=None) -> torch.Tensor:
    """oscar's INT2 history: rows ``x [B, S, Hkv, d]`` rotated, centered (``center [Hkv, d]``, the
    keys' shift ``μ @ R``; None: not), clipped, quantised with fp16 scale/offset exactly as
    :func:`oscar_calib.kernels.quantize_kv` stores them and dequantised (float32, still rotated and
    centered). ``cache`` (``"k"`` or ``"v"``) is unused here."""
    from ..kernels import quantize_kv

    return quantize_kv(x, rotation, clip, group_size, center=center).dequantize()


def oscar_rows(sch: KVScheme, layer: int, q, k, v, store=kernel_store):
    """oscar's storage: ``(query, bf16 keys, bf16 values, INT2 keys, INT2 values, output map)``, all in
    the model's basis (the INT2 rows rotated, centered with key centering, clipped, quantised by
    ``store``, then rotated back and the key mean added back); the query as it comes.
    ``store(x, rotation, clip, group_size, cache, center=None)`` (see :func:`kernel_store`) is how
    another 4-level quantiser on oscar's rotations and clips is simulated
    (:mod:`oscar_calib.experimental`)."""
    wd = sch.window_dtype
    k_in = k.to(wd) if wd is not None else k
    v_in = v.to(wd) if wd is not None else v
    ls = sch.layer(layer)
    rk, ck, rv, cv = ls.on(q.device)
    mean = ls.mean_on(q.device)                                         # [Hkv, d] or None
    k_lo = v_lo = None
    if sch.quantized:
        gk, gv = sch.groups(layer)
        kq = store(k_in.transpose(1, 2), rk, ck, gk, "k", center=ls.k_shift(q.device))   # [B, S, Hkv, d] rotated
        vq = store(v_in.transpose(1, 2), rv, cv, gv, "v")
        k_lo = torch.einsum("bshe,hde->bhsd", kq, rk) if rk is not None else kq.transpose(1, 2)
        v_lo = torch.einsum("bshe,hde->bhsd", vq, rv) if rv is not None else vq.transpose(1, 2)
        if mean is not None:                 # back in the model's basis: the shift every stored key carries
            k_lo = k_lo + mean[:, None]
    out_rot = sch.v_output[layer]        # absorbed R_v: map the output back, o @ Rᵀ per KV head
    back = output_unrotation(out_rot.to(q.device, torch.float32), q.shape[1] // k.shape[1]) \
        if out_rot is not None else None
    hold = wd or k.dtype                 # what the real cache's window holds (its window dtype, else the model's)
    if not sch.quantized:                # nothing is rotated: the rows as the dtype holds them
        rk = rv = None
    return q.float(), window_rows(k, rk, hold, mean), window_rows(v, rv, hold), k_lo, v_lo, back


def window_rows(x: torch.Tensor, rotation: torch.Tensor | None, dtype, mean: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``x [B, H, S, d]`` as :class:`~oscar_calib.runtime.cache.OscarCache`'s 16-bit window
    holds them, back in the model's basis (float32): the cache stores ``dtype(dtype(x) @ R)``, in
    the rotated basis, and reads them with the query rotated alike (``(qR)·(xR)ᵀ``), so the
    simulation reads ``dtype(dtype(x) @ R) @ Rᵀ``. Without a rotation, or with a 32-bit ``dtype``,
    the second rounding is none: ``dtype(x)``. Keys centered on ``mean [H, d]`` (key centering) are
    stored ``dtype(dtype(x) @ R − μR)`` and read back as ``… @ Rᵀ + μ`` (without a rotation
    ``dtype(dtype(x) − μ) + μ``)."""
    xb = x.to(dtype).float()
    if torch.finfo(dtype).bits >= 32 or (rotation is None and mean is None):
        return xb
    mu = None if mean is None else mean.to(x.device, torch.float32)
    if rotation is None:
        return _round(xb - mu[:, None], dtype) + mu[:, None]
    r = rotation.to(x.device, torch.float32)
    y = torch.einsum("bhsd,hde->bhse", xb, r)
    if mu is None:
        return torch.einsum("bhse,hde->bhsd", _round(y, dtype), r)
    shift = key_shift(mean, rotation).to(x.device)
    return torch.einsum("bhse,hde->bhsd", _round(y - shift[:, None], dtype), r) + mu[:, None]


def fork_rows(sch: KVScheme, layer: int, q, k, v):
    """The OSCAR SGLang fork's storage, in the rotated basis as its KV pool holds it (``hp`` =
    ``window_dtype``, its ``SGLANG_MIXED_KV_HP_DTYPE``; None: no rounding):

    * query, keys, values: ``hp(hp(x) @ hp(R))`` (a 16-bit GEMM with fp32 accumulation; the query
      takes its KV head's ``R_k``), which the BF16 sink and window hold as they are;
    * INT2 history: those rows clipped (:func:`~oscar_calib.numerics.quant.clip_rows`, one ratio per
      cache) and fake-quantised with the fork's float32 scale and zero
      (:func:`~oscar_calib.numerics.quant.fake_quant_fork`, uniform or Lloyd-Max), dequantised in
      float32;
    * output: ``hp(hp(o_rot) @ hp(R_v)ᵀ)``.

    With ``v_rotation`` None and ``v_output`` set (R_v absorbed into the V projection), V is stored
    as the model computes it and the output mapped back with ``v_output``."""
    from ..numerics.quant import clip_rows, fake_quant_fork

    hp = sch.window_dtype
    grp = q.shape[1] // k.shape[1]
    rk, ck, rv, cv = sch.layer(layer).on(q.device)

    def rotate(x, r):                      # x [B, H, S, d], r [H, d, d] or None
        xb = _round(x, hp)
        return xb if r is None else _round(torch.einsum("bhsd,hde->bhse", xb, _round(r, hp)), hp)

    qr = rotate(q, None if rk is None else rk.repeat_interleave(grp, 0))
    kr, vr = rotate(k, rk), rotate(v, rv)
    k_lo = v_lo = None
    if sch.quantized:
        lloyd = sch.quantizer == "fork-lloyd"

        def int2(x, c, g):
            y = x if c is None else clip_rows(x, c.to(torch.float64).view(-1, 1))
            return fake_quant_fork(y, g, lloyd=lloyd)

        gk, gv = sch.groups(layer)
        k_lo, v_lo = int2(kr, ck, gk), int2(vr, cv, gv)
    out = rv if rv is not None else sch.v_output[layer]
    back = output_unrotation(out.to(q.device, torch.float32), grp, hp) if out is not None else None
    return qr, kr, vr, k_lo, v_lo, back


def vllm_rows(sch: KVScheme, layer: int, q, k, v):
    """vLLM's storage (pull request #46774; :mod:`oscar_calib.numerics.engines`), in the rotated basis:
    query, keys and values rotated in float32 by the layer's ``R``; the INT2 history clipped (one K and
    one V ratio) and stored as one group per head vector with fp16 scale and minimum; the output
    mapped back with ``o @ R_vᵀ`` in float32. The window (none at the cited revision) holds the
    rotated rows in ``window_dtype``."""
    from ..numerics.engines import fake_quant_vllm
    from ..numerics.quant import clip_rows

    wd = sch.window_dtype
    if not sch.quantizes(layer):              # a native layer: vLLM's own attention, K/V in the model's dtype
        return q.float(), _round(k, wd), _round(v, wd), None, None, None
    grp = q.shape[1] // k.shape[1]
    rk, ck, rv, cv = sch.layer(layer).on(q.device)

    def rotate(x, r):
        return x.float() if r is None else torch.einsum("bhsd,hde->bhse", x.float(), r)

    qr = rotate(q, None if rk is None else rk.repeat_interleave(grp, 0))
    kr, vr = rotate(k, rk), rotate(v, rv)

    def int2(x, c):
        return fake_quant_vllm(x if c is None else clip_rows(x, c.to(torch.float64).view(-1, 1)))

    k_lo, v_lo = int2(kr, ck), int2(vr, cv)
    back = output_unrotation(rv, grp) if rv is not None else None
    return qr, _round(kr, wd), _round(vr, wd), k_lo, v_lo, back


def llamacpp_rows(sch: KVScheme, layer: int, q, k, v):
    """llama.cpp's storage (OSCAR's ``zhongzhu/llamacpp`` branch; :mod:`oscar_calib.numerics.engines`),
    in the rotated basis: float32 rotations (``attn_k_rot`` / ``attn_v_rot``); the history as
    ``q2_0`` written over each token's whole row (KV heads concatenated) with ONE clip ratio and read
    back per head; the sink and recent window in F16; the query scored against the ``q2_0`` keys as
    ``q8_0`` and against the window as F16, the window's attention weights rounded to F16 before they
    meet its F16 values (the CPU path of ``build_attn``'s joint LP+HP softmax); the output mapped back
    with ``o @ R_vᵀ`` in float32."""
    from ..numerics.engines import fake_quant_q2_0, fake_quant_q8_0

    b, hkv, s, d = k.shape
    grp = q.shape[1] // hkv
    rk, ck, rv, _ = sch.layer(layer).on(q.device)

    def rotate(x, r):
        return x.float() if r is None else torch.einsum("bhsd,hde->bhse", x.float(), r)

    qr = rotate(q, None if rk is None else rk.repeat_interleave(grp, 0))
    kr, vr = rotate(k, rk), rotate(v, rv)
    clip = None if ck is None else float(ck[0])
    k_lo = v_lo = q_lo = None
    if sch.quantizes(layer):
        def q2(x):                                   # [B, H, S, d] -> rows [B, S, H*d] -> back
            rows = x.transpose(1, 2).reshape(b, s, hkv * d)
            return fake_quant_q2_0(rows, d, clip).reshape(b, s, hkv, d).transpose(1, 2)

        k_lo, v_lo = q2(kr), q2(vr)
        q_lo = fake_quant_q8_0(qr)
    wd = sch.window_dtype
    back = output_unrotation(rv, grp) if rv is not None else None
    return _round(qr, wd), _round(kr, wd), _round(vr, wd), k_lo, v_lo, back, q_lo, wd


# How SimulatedKV reads each quantiser (KVScheme.quantizer): ``rows(scheme, layer, q, k, v)`` returns
# ``(query, bf16 keys, bf16 values, INT2 keys, INT2 values, output map)`` (see :func:`oscar_rows`), and for
# an engine's scheme also its low-precision query and window dtype (:func:`llamacpp_rows`).
ROWS = {"oscar": oscar_rows, "fork": fork_rows, "fork-lloyd": fork_rows, "vllm": vllm_rows, "llamacpp": llamacpp_rows}
assert set(ROWS) == set(QUANTIZERS)


def register_quantizer(name: str, rows) -> None:
    """Let :class:`SimulatedKV` read schemes whose ``quantizer`` is ``name`` with ``rows`` (same
    signature and result as :func:`oscar_rows`). The one extension point for quantisers outside
    the product: :mod:`oscar_calib.experimental` registers its own on import. The built-in names
    cannot be replaced."""
    if name in QUANTIZERS:
        raise ValueError(f"quantizer {name!r} is built in")
    ROWS[name] = rows
