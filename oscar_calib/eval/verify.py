"""``oscar verify``: check an artifact with the INT2 kernels on held-out activations.

Procedure
---------
1. Held-out tokens: ``--sequences`` sequences of the embedded corpus' ``heldout`` half (never used
   by ``oscar calibrate``'s default data), or of ``--data``. Each is run once through the model
   with capture on; post-RoPE Q/K/V and the model's own attention output are kept per layer.
2. For every depth ``T`` (total context, ``--depths``) and ``--positions`` query positions
   ``p = T-1, T-8, T-15, …``: the query is the token at ``p``, the cache holds tokens ``[0, p]``
   (a sliding-window layer holds only its window). All of them go through the kernels as one
   batch of sequences with different lengths.
   K and V go through the write kernel (rotation, clip, INT2) with the first ``sink`` and last
   ``recent`` tokens kept in BF16, exactly as at serving time, and the decode kernel computes
   the attention output (un-rotated back with ``Rᵀ``). A chunked-attention layer (Llama 4) holds the
   tokens of the query's chunk only; a model with attention sinks (gpt-oss) has them added to the
   kernel's softmax, as its own attention does. An artifact with key centering stores every key
   (window and history) centered on its ``k_mean``, as the cache does.
3. Per layer, relative errors against full-precision attention (the model's own output):
   ``attn`` = ‖o_int2 − o‖ / ‖o‖ and ``logit`` = ‖q K̂ᵀ − q Kᵀ‖ / ‖q Kᵀ‖ over the cached tokens,
   pooled over depths, sequences and heads.
4. The same for a Hadamard (QuaRot-style) baseline with the same sink, window and group size and
   clips 0.96/0.92. An artifact with per-layer group sizes (``layer_group_sizes``, a bit budget;
   ``layer_v_group_sizes``, the values' when they differ) is verified, and its baseline run, with
   each layer's own sizes.
5. ``fork`` (informational, when the artifact has shared rotations and a global clip pair): the
   ``attn`` error of what the OSCAR SGLang fork's main serves for the artifact (one rotation per
   layer held in BF16, one K and one V clip ratio, float32 scale/zero; ``oscar eval``'s ``fork``
   method), computed by the pure-torch simulation
   (:class:`~oscar_calib.runtime.simulate.SimulatedKV`), not the kernels: our kernels store fp16
   scales.

Pass when the artifact's mean ``attn`` error is below the baseline's and no layer's ``attn``
error exceeds ``--max-layer-error`` (default 0.5). Measured on SmolLM2-135M at depths
512/1024/2048: calibrated rotations give 0.04–0.35 per layer (mean ≈ 0.11), the Hadamard
baseline 0.06–0.49 (mean ≈ 0.16); identity rotations without clipping fail on the mean.
Writes ``verify.json`` and ``verify.png`` into the artifact directory. ``verify.json`` records what
it measured (:func:`~oscar_calib.contract.verification.provenance`): the content digest of the artifact
as it was read (``content_sha256``), the fingerprint of the model it ran and the toolkit version, so
the verification holds for that content only (``oscar push``, ``oscar validate``: "verified: stale"
once the artifact changes).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..contract.artifact import (
    load_artifact,
    require_compatible,
)
from ..contract.defaults import BASELINE_CLIPS
from ..contract.layout import VERIFY_NAME
from ..contract.verification import provenance
from ..errors import InputError
from ..fsutil import atomic_write_bytes, atomic_write_text
from ..model.load import LoadedModel
from ..model.placement import input_device
from ..numerics.hadamard import hadamard
from ..progress import ProgressFn, counter, step
from ..runtime.scheme import key_shift

DEFAULT_DEPTHS = (512, 1024, 2048)
# what ``oscar calibrate --quick`` verifies with: one held-out sequence, depths up to 1024
QUICK_VERIFY = {"depths": (512, 1024), "sequences": 1}
DEFAULT_MAX_LAYER_ERROR = 0.5
POSITION_STRIDE = 7
PLOT_NAME = "verify.png"


@dataclass
class VerifyResult:
    layers: list[dict]
    settings: dict
    passed: bool
    reasons: list[str] = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)   # what was verified: content digest, model, toolkit

    def summary(self) -> dict:
        mean = lambda k, m: sum(r[m][k] for r in self.layers) / len(self.layers)  # noqa: E731
        return {
            "passed": self.passed, "reasons": self.reasons,
            "mean_attn_error": mean("attn", "artifact"), "mean_attn_error_hadamard": mean("attn", "hadamard"),
            "mean_logit_error": mean("logit", "artifact"), "mean_logit_error_hadamard": mean("logit", "hadamard"),
            "max_layer_attn_error": max(r["artifact"]["attn"] for r in self.layers),
            "worst_layer": max(self.layers, key=lambda r: r["artifact"]["attn"])["layer"],
        } | ({"mean_attn_error_fork": mean("attn", "fork")} if all("fork" in r for r in self.layers) else {})

    def to_json(self) -> dict:
        return {"passed": self.passed, **self.provenance, "summary": self.summary(), "settings": self.settings,
                "layers": self.layers, "timings": self.timings}


def check_backend(backend: str) -> None:
    """Refuse, before any model loads, a kernel backend this install cannot run: an unknown name, or
    ``triton`` where the triton package does not import (it has wheels for Linux only)."""
    from ..kernels import BACKENDS, triton_available

    if backend not in BACKENDS:
        raise InputError(f"unknown backend {backend!r}; choose {', '.join(BACKENDS)}")
    if backend == "triton" and not triton_available():
        raise InputError("--backend triton needs the triton package, which is not installed here (it has wheels "
                         "for Linux only); use --backend auto or torch")


def _backend(backend: str, device: torch.device) -> str:
    if backend == "triton" and device.type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")   # CPU: the Triton interpreter
    return backend


def _samples(depths, positions: int, stride: int, window: int | None, chunk: int | None = None) -> list[tuple[int, int]]:
    """(start, end) token ranges: for every depth T, ``positions`` query positions T-1, T-1-stride, …;
    the cache of a query at position e-1 holds [start, e) (a sliding window keeps only its last
    ``window`` tokens, a chunked layer the tokens of the query's ``chunk``)."""
    out = []
    for depth in depths:
        for j in range(positions):
            end = depth - j * stride
            if end >= 2:
                start = max(0, end - window) if window else (end - 1) // chunk * chunk if chunk else 0
                out.append((start, end))
    return out


PAGE = 16


def _layer_errors(caps: dict, samples, rot_k, clip_k, rot_v, clip_v, *, group_size, v_group_size, sink, recent,
                  backend, scaling: float, logit_correction: float = 0.0, sinks=None, k_mean=None) -> dict:
    """Relative attention-output and logit errors of one layer, pooled over all samples (the
    attention output with the artifact's logit-noise correction and, given ``k_mean [H, d]``, the
    keys centered on it, as the cache serves it).

    Quantisation is per token, so every held-out sequence goes through the write kernel once;
    each sample's INT2 history is a run of pages of its sequence (paged layout: samples that
    share a start share pages), and its BF16 sink and window are its own."""
    from ..kernels import (
        Int2KVCache,
        decode_attention,
        dequantize_packed,
        quantize_kv,
        split_lengths,
    )

    k_all, v_all = caps["k"], caps["v"]                                       # [B, T, H, d]
    q_all, o_all, at = caps["q"], caps["o"], caps["at"]     # [B, P, H, d] at the query positions; at[pos] -> P
    n_seq, _, h, d = k_all.shape
    dev = k_all.device
    shift = key_shift(k_mean, rot_k)                                          # [H, d]: μ @ R_k, or None
    qk = quantize_kv(k_all, rot_k, clip_k, group_size, center=shift, backend=backend)       # the write kernel
    qv = quantize_kv(v_all, rot_v, clip_v, v_group_size, backend=backend)
    kr = torch.einsum("bthd,hde->bthe", k_all.float(), rot_k.float())
    if shift is not None:
        kr = kr - shift
    vr = torch.einsum("bthd,hde->bthe", v_all.float(), rot_v.float())
    rows = [(b, s, e) for b in range(n_seq) for s, e in samples]
    parts = [split_lengths(e - s, sink, recent) for _, s, e in rows]

    # pages: one run per (sequence, start), long enough for its longest history
    runs: dict[tuple[int, int], int] = {}
    for (b, s, _), (ns, nh, _) in zip(rows, parts):
        runs[(b, s)] = max(runs.get((b, s), 0), nh)
    names = ("k_codes", "k_scale", "k_offset", "v_codes", "v_scale", "v_offset")
    srcs = dict(zip(names, (qk.codes, qk.scale, qk.offset, qv.codes, qv.scale, qv.offset)))
    n_pages = {key: -(-n // PAGE) for key, n in runs.items()}
    total = max(1, sum(n_pages.values()))
    pools = {n: torch.zeros(total, h, PAGE, t.shape[-1], dtype=t.dtype, device=dev) for n, t in srcs.items()}
    first_page, nxt = {}, 0
    for (b, s), n in runs.items():
        first_page[(b, s)] = nxt
        h0 = s + sink                                      # a non-empty history starts after the sink
        for j in range(n_pages[(b, s)]):
            t0, t1 = h0 + j * PAGE, min(h0 + n, h0 + (j + 1) * PAGE)
            for name, src in srcs.items():
                pools[name][nxt + j, :, : t1 - t0] = src[b, t0:t1].transpose(0, 1)
        nxt += n_pages[(b, s)]
    width = max(1, max(n_pages.values(), default=1))
    table = torch.zeros(len(rows), width, dtype=torch.int32)
    ncap = max(1, max(ns + nr for ns, _, nr in parts))
    k16 = torch.zeros(len(rows), h, ncap, d, dtype=torch.bfloat16, device=dev)
    v16 = torch.zeros_like(k16)
    for n, ((b, s, e), (ns, nh, nr)) in enumerate(zip(rows, parts)):
        p0 = first_page[(b, s)]
        table[n, : n_pages[(b, s)]] = torch.arange(p0, p0 + n_pages[(b, s)], dtype=torch.int32)
        idx = torch.cat([torch.arange(s, s + ns), torch.arange(e - nr, e)]).to(dev)
        k16[n, :, : ns + nr] = kr[b, idx].transpose(0, 1).to(torch.bfloat16)
        v16[n, :, : ns + nr] = vr[b, idx].transpose(0, 1).to(torch.bfloat16)
    cache = Int2KVCache(pools["k_codes"], pools["k_scale"], pools["k_offset"], pools["v_codes"], pools["v_scale"],
                        pools["v_offset"], torch.tensor([nh for _, nh, _ in parts], dtype=torch.int32, device=dev),
                        k16, v16, torch.tensor([ns + nr for ns, _, nr in parts], dtype=torch.int32, device=dev),
                        group_size, table.to(dev), v_group_size=v_group_size)
    q = torch.stack([q_all[b, at[e - 1]] for b, _, e in rows])             # [N, Hq, d]
    ref = torch.stack([o_all[b, at[e - 1]] for b, _, e in rows]).float()
    o = decode_attention(q, cache, k_rotation=rot_k, v_rotation=rot_v, unrotate=True, sm_scale=scaling,
                         out_dtype=torch.float32, backend=backend, logit_correction=logit_correction,
                         sinks=sinks)                                                          # the kernel
    num_o = float((o.float() - ref).pow(2).sum())
    den_o = float(ref.pow(2).sum())
    # logits over each sample's cached tokens: INT2 history dequantised, sink/window exact
    deq = dequantize_packed(qk.codes, qk.scale, qk.offset, group_size)
    kq_all = torch.einsum("bthe,hde->bthd", deq, rot_k.float())
    if k_mean is not None:
        kq_all = kq_all + k_mean.float()
    grp = q.shape[1] // h
    num_l = den_l = 0.0
    for n, ((b, s, e), (ns, nh, _)) in enumerate(zip(rows, parts)):
        qn = q[n].float().reshape(h, grp, d)
        s_ref = torch.einsum("hgd,thd->hgt", qn, k_all[b, s:e].float())
        s_q = s_ref.clone()
        if nh:
            s_q[..., ns:ns + nh] = torch.einsum("hgd,thd->hgt", qn, kq_all[b, s + ns:s + ns + nh])
        num_l += float((s_q - s_ref).pow(2).sum())
        den_l += float(s_ref.pow(2).sum())
    return {"attn": math.sqrt(num_o / max(den_o, 1e-300)), "logit": math.sqrt(num_l / max(den_l, 1e-300)),
            "samples": len(rows)}


def _fork_layer_errors(caps: dict, samples, scheme, layer: int, scaling: float, window: int | None,
                       sinks=None) -> dict:
    """Relative attention-output error of the fork's scheme for one layer, pooled like ``attn``: each
    sample's query reads its cache through :class:`~oscar_calib.runtime.simulate.SimulatedKV` (BF16
    sink and window by absolute position, the rest INT2 the fork's way). One call covers every
    sample: the keys up to the last end, each query row masked to its own prefix (the fork stores
    every token alone, so a prefix's rows are the longer prefix's)."""
    from ..runtime.simulate import SimulatedKV

    ends = sorted({e for _, e in samples})
    rows = [caps["at"][e - 1] for e in ends]
    q = caps["q"][:, rows].transpose(1, 2)                                  # [B, Hq, T, d]
    k, v = caps["k"][:, :ends[-1]].transpose(1, 2), caps["v"][:, :ends[-1]].transpose(1, 2)
    o = SimulatedKV(None, scheme).attend(layer, q, k, v, None, scaling, window, None,
                                         positions=[e - 1 for e in ends], sinks=sinks)    # [B, T, Hq, d]
    ref = caps["o"][:, rows].float()
    return {"attn": math.sqrt(float((o - ref).pow(2).sum()) / max(float(ref.pow(2).sum()), 1e-300))}


def _fork_scheme(art):
    """The fork's scheme for the artifact, or None when it has no shared rotations / global clips."""
    from ..runtime.scheme import KVScheme, fork_unavailable

    if fork_unavailable(art):
        return None
    return KVScheme.shared_from_artifact(art, quantizer="fork")


def verify_artifact(path: Path, *, model: str | None = None, loaded: LoadedModel | None = None, device: str = "auto",
                    dtype: str = "auto", backend: str = "auto", depths=DEFAULT_DEPTHS, sequences: int = 2,
                    positions: int = 8, data: str = "embedded", max_layer_error: float = DEFAULT_MAX_LAYER_ERROR,
                    seed: int = 0, write: bool = True, plot: bool = True, quiet: bool = False,
                    progress: ProgressFn | None = None, placement=None) -> VerifyResult:
    """Verify an artifact; see the module docstring. ``loaded`` (a :class:`LoadedModel`) uses a
    model already in memory instead of loading ``model``; ``placement``
    (:class:`~oscar_calib.model.placement.Placement`) spreads a big one over GPUs, CPU and disk.
    A spread model's captures are kept on the CPU and checked one layer at a time on the device
    its inputs go to. The artifact is validated first (``oscar validate``'s rules: a NaN or a
    non-orthogonal rotation is refused with its line).

    ``backend``: the kernels' (``auto``: Triton on CUDA where triton is installed, the torch
    references otherwise). ``triton`` where triton is not installed (it has wheels for Linux only)
    is refused with one :class:`InputError` before anything loads, rather than falling back: a run
    that asks for the kernels must not silently check the references instead."""
    from ..data.corpus import load_texts, plan_tokens
    from ..model.capture import Capture, call_window, capture_forward
    from ..model.load import load_model

    t0 = time.perf_counter()
    check_backend(backend)
    path = Path(path)
    if loaded is not None and not isinstance(loaded, LoadedModel):
        raise TypeError("verify_artifact(loaded=...) takes a LoadedModel (LoadedModel.wrap(model, tokenizer, source))")
    art = load_artifact(path)           # every check of oscar validate, the content digest included
    depths = sorted({int(d) for d in depths})
    if not depths or depths[0] < 2:
        raise InputError("--depths must be integers ≥ 2")
    if not 0 < max_layer_error:
        raise InputError("--max-layer-error must be positive")
    documents = load_texts(data)         # a bad --data is reported before the model loads
    if loaded is None:
        from ..model.source import model_for_artifact

        model = model or model_for_artifact(art.metadata)
        loaded = load_model(model, device=device, dtype=dtype, placement=placement, progress=progress)
    lm = loaded
    require_compatible(art, lm.geometry, lm.fingerprint, model_name=lm.source.model_id)
    geo = lm.geometry
    dev = input_device(lm.model)
    spread = len(set(getattr(lm.model, "hf_device_map", {"": 0}).values())) > 1
    backend = _backend(backend, dev)
    st = art.settings
    sink, recent, group_size = st.sink_tokens, st.recent_tokens, st.group_size
    max_depth = depths[-1]
    plan = plan_tokens(lm.tokenizer, data=data, tokens=max_depth, seq_len=max_depth, heldout_tokens=max_depth,
                       heldout_seqs=sequences, seed=seed + 1, corpus_split="heldout", documents=documents)
    ids = torch.stack(plan.heldout)                                    # [B, max_depth]
    caps: dict[int, dict] = {}
    info: dict[int, dict] = {}
    # queries and outputs are needed only where a sample's query sits (K/V: every position); one
    # sequence per forward pass, so the pass's own activations are those of one sequence
    query_at = sorted({e - 1 for _, e in _samples(depths, positions, POSITION_STRIDE, None)})
    at = {p: j for j, p in enumerate(query_at)}
    sel = torch.tensor(query_at, device=dev)
    seq = [0]

    def observe(layer, module, q, k, v, o, kwargs):
        ix = sel.to(q.device)
        got = {"q": q.index_select(2, ix).transpose(1, 2), "k": k.transpose(1, 2), "v": v.transpose(1, 2),
               "o": o.index_select(1, ix.to(o.device))}
        if layer not in caps:                 # a spread model's captures wait on the CPU
            caps[layer] = {n: torch.empty((len(ids), *t.shape[1:]), dtype=torch.float32,
                                          device="cpu" if spread else dev) for n, t in got.items()} | {"at": at}
        for n, t in got.items():
            caps[layer][n][seq[0]] = t[0]
        sinks = kwargs.get("s_aux")
        info[layer] = {"scaling": float(getattr(module, "scaling", q.shape[-1] ** -0.5)),
                       "window": call_window(module, kwargs),
                       "sinks": None if sinks is None else sinks.detach().float().to("cpu" if spread else dev)}

    with step(progress, "verify: held-out pass"), torch.no_grad(), Capture(lm.model, [observe]):
        for seq[0] in range(len(ids)):
            capture_forward(lm.model, ids[seq[0]:seq[0] + 1].to(dev))
    t_capture = time.perf_counter() - t0
    fork = _fork_scheme(art)
    rows = []
    tick = counter(progress, "verify: INT2 kernels", len(art.layers), "layers")
    for i, layer in enumerate(art.layers):
        gk, gv = st.layer_groups[i]
        kw = dict(group_size=gk, v_group_size=gv, sink=sink, recent=recent, backend=backend,
                  scaling=info[i]["scaling"])
        chunk = geo.layer(i).window if geo.layer_types[i] == "chunked_attention" else None
        samples = _samples(depths, positions, POSITION_STRIDE, info[i]["window"], chunk)
        cap = {k: t.to(dev) if torch.is_tensor(t) else t for k, t in caps.pop(i).items()}  # a layer at a time on dev
        sinks = None if info[i]["sinks"] is None else info[i]["sinks"].to(dev)
        kw["sinks"] = sinks
        ours = _layer_errors(cap, samples, layer.k_rotation.to(dev), layer.k_clip.to(dev),
                             layer.v_rotation.to(dev), layer.v_clip.to(dev), **kw,
                             logit_correction=st.logit_correction,
                             k_mean=None if layer.k_mean is None else layer.k_mean.to(dev))
        hk, d = geo.kv_heads[i], geo.head_dims[i]         # the Hadamard baseline at this layer's heads
        h = hadamard(d, warn=False).float().to(dev).expand(hk, -1, -1).contiguous()
        base_k = torch.full((hk,), BASELINE_CLIPS[0], device=dev)
        base_v = torch.full((hk,), BASELINE_CLIPS[1], device=dev)
        base = _layer_errors(cap, samples, h, base_k, h, base_v, **kw)
        rows.append({"layer": i, **({"model_layer": geo.ids[i]} if geo.layer_ids is not None else {}),
                     "attention": geo.layer_types[i] if i < len(geo.layer_types) else "full_attention",
                     "artifact": ours, "hadamard": base})
        if fork is not None:
            rows[-1]["fork"] = _fork_layer_errors(cap, samples, fork, i, info[i]["scaling"], info[i]["window"], sinks)
        tick(i + 1)
    reasons = []
    mean_o = sum(r["artifact"]["attn"] for r in rows) / len(rows)
    mean_h = sum(r["hadamard"]["attn"] for r in rows) / len(rows)
    if not mean_o < mean_h:
        reasons.append(f"mean attention error {mean_o:.4f} is not below the Hadamard baseline's {mean_h:.4f}")
    bad = [r["layer"] for r in rows if r["artifact"]["attn"] > max_layer_error]
    if bad:
        reasons.append(f"layers {bad[:8]}{'…' if len(bad) > 8 else ''} exceed --max-layer-error {max_layer_error}")
    settings = {"model_id": art.metadata.get("model_id"), "backend": backend, "device": str(dev), "spread": spread,
                "depths": depths,
                "sequences": sequences, "positions_per_depth": positions, "position_stride": POSITION_STRIDE, "data": plan.source, "sink_tokens": sink, "recent_tokens": recent,
                "group_size": group_size, "max_layer_error": max_layer_error, "baseline_clips": list(BASELINE_CLIPS),
                "token_sha256": plan.sha256(), "key_centering": st.key_centering}
    if st.per_layer_groups:
        settings["layer_group_sizes"] = st.k_groups
    if st.split_groups:
        settings["layer_v_group_sizes"] = st.v_groups
    if fork is not None:
        settings["fork"] = {"k_clip": st.shared_clips[0], "v_clip": st.shared_clips[1], "group_size": fork.group_size,
                            "sink_tokens": fork.sink, "recent_tokens": fork.recent,
                            "simulation": "pure torch: shared rotation in bf16, float32 scale/zero"}
    result = VerifyResult(rows, settings, not reasons, reasons,
                          {"capture_s": t_capture, "total_s": time.perf_counter() - t0},
                          provenance(art.content_sha256, lm.fingerprint))
    if write:
        atomic_write_text(path / VERIFY_NAME, json.dumps(result.to_json(), indent=2, sort_keys=True) + "\n")
        if plot:
            write_plot(path / PLOT_NAME, result)
    return result


def write_plot(path: Path, result: VerifyResult) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [r["layer"] for r in result.layers]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), constrained_layout=True)
    for ax, key, title in ((axes[0], "attn", "attention-output error"), (axes[1], "logit", "logit error")):
        ax.plot(layers, [r["artifact"][key] for r in result.layers], "o-", label="artifact")
        ax.plot(layers, [r["hadamard"][key] for r in result.layers], "s--", label="Hadamard 0.96/0.92")
        if key == "attn" and all("fork" in r for r in result.layers):
            ax.plot(layers, [r["fork"]["attn"] for r in result.layers], "^:", label="fork's scheme (simulated)")
        if key == "attn":
            ax.axhline(result.settings["max_layer_error"], color="red", lw=0.8, label="threshold")
        ax.set_xlabel("layer")
        ax.set_ylabel("relative error")
        ax.set_title(f"{title} (depths {result.settings['depths']})")
        ax.legend()
    fig.suptitle(f"oscar verify: {result.settings['model_id']} — {'PASS' if result.passed else 'FAIL'}")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
