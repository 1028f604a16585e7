"""``oscar eval``: held-out perplexity and needle-in-a-haystack retrieval with a 2-bit KV cache.

Methods (every INT2 method uses the same group size, sink and recent window):

============  ===========================================================================
method        what the KV cache holds
============  ===========================================================================
``bf16``      every K/V row in BF16 (the reference)
``naive``     INT2 history, no rotation, no clip
``hadamard``  INT2 history, Walsh–Hadamard rotation (QuaRot-style), clips 0.96/0.92
``oscar``     INT2 history with the artifact's rotations and clips
``quanto``    transformers' own ``QuantizedCache`` (optimum-quanto, 2 bits) at its defaults:
              residual length 128, group 64, no sink
============  ===========================================================================

Perplexity (``task="ppl"``) is teacher-forced on held-out text (the embedded corpus' ``heldout``
half by default: 2 sequences × 2048 tokens), faithful to decoding: for every query position
``i``, key/value ``j`` is read in BF16 when ``j < sink`` or ``i − j < recent`` and as INT2 (rotated,
clipped, quantised, stored with fp16 scale/offset exactly as :mod:`oscar_calib.kernels` stores it)
otherwise. It runs in one forward pass per sequence through an attention function registered with
transformers' ``AttentionInterface`` (:class:`SimulatedKV`) that computes the scores with both key
versions and picks per (i, j), and splits the probabilities into their BF16 and INT2 parts for
``P·V``; the model's causal and sliding-window masks and GQA are honoured, math is float32. With
nothing quantised it equals plain attention (tested). ``quanto`` has no such simulation: it
decodes the text token by token through a real ``QuantizedCache``.

Needle in a haystack (``task="niah"``, RULER's ``niah_single`` style): a needle "One of the
special magic numbers for {key} is: {value}." (a random word pair and a 7-digit number) is placed
at several depths of filler text (held-out corpus sentences, or RULER's repeated "noise"
sentences), followed by the question. The prompt (all but its last token) is prefilled once in
full precision, as a serving engine prefills; each method's cache is built from that prefill
(INT2 history written exactly as :class:`~oscar_calib.oscar_cache.OscarCache` writes it), and
``model.generate`` answers greedily from the last prompt token, so every answer token, the first
included, is decoded through the method's cache. Score: 1 when the first number in the answer
equals the value, else 0.
"""

from __future__ import annotations

import copy
import math
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .capture import AttentionRoute
from .clip import BASELINE_CLIPS
from .errors import InputError, OscarError
from .oscar_cache import DEFAULT_RECENT, DEFAULT_SINK, KVScheme, OscarCache

METHODS = ("bf16", "naive", "hadamard", "oscar", "quanto")
TASKS = ("ppl", "niah")
SIM_NAME = "oscar_kv_sim"
QUANTO_DEFAULTS = {"nbits": 2, "residual_length": 128, "q_group_size": 64}

_ACTIVE: list["SimulatedKV"] = []


class EvalError(OscarError):
    """An evaluation cannot run as asked."""


# ----------------------------------------------------------------------------- methods

def parse_methods(text: str | list[str]) -> list[str]:
    items = [m.strip().lower() for m in (text.split(",") if isinstance(text, str) else text) if m.strip()]
    if not items:
        raise InputError("--methods is empty")
    bad = [m for m in items if m not in METHODS]
    if bad:
        raise InputError(f"unknown method(s) {', '.join(bad)}; choose from {', '.join(METHODS)}")
    return list(dict.fromkeys(items))


def build_schemes(methods: list[str], geo, *, artifact=None, group_size: int | None = None, sink: int = DEFAULT_SINK,
                  recent: int = DEFAULT_RECENT, hadamard_clips=BASELINE_CLIPS) -> dict[str, KVScheme]:
    """The :class:`KVScheme` of every simulated method (``quanto`` has none). The group size is
    ``group_size``, else the artifact's, else ``min(128, head_dim)``."""
    from .quant import check_group_size, default_group_size

    if "oscar" in methods and artifact is None:
        raise InputError("method 'oscar' needs an ARTIFACT (or leave it out of --methods)")
    g = group_size or (artifact.group_size if artifact is not None else default_group_size(geo.head_dim))
    check_group_size(geo.head_dim, g)
    out = {}
    for m in methods:
        if m == "bf16":
            out[m] = KVScheme.full_precision(geo.num_layers, sink=sink, recent=recent)
        elif m in ("naive", "hadamard"):
            rot, clips = ("identity", (1.0, 1.0)) if m == "naive" else ("hadamard", tuple(hadamard_clips))
            out[m] = KVScheme.uniform(m, geo.num_layers, geo.num_kv_heads, geo.head_dim, g, rotation=rot,
                                      clips=clips, sink=sink, recent=recent)
        elif m == "oscar":
            out[m] = KVScheme.from_artifact(artifact, group_size=g, sink=sink, recent=recent)
    return out


def bits_of(method: str, scheme: KVScheme | None) -> float:
    """Stored bits per INT2-history element (16 for bf16; quanto: 2 + 32/64 with 16-bit params)."""
    if method == "quanto":
        return 2.0 + 32.0 / QUANTO_DEFAULTS["q_group_size"]
    if scheme is None or not scheme.quantized:
        return 16.0
    return scheme.bits_per_element


# ----------------------------------------------------------------------------- simulated attention

def _sim_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                   softcap=None, **kwargs):
    sim = _ACTIVE[-1]
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise EvalError(f"{type(module).__name__} has no layer_idx")
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = sim.attend(layer, query, key, value, attention_mask, scale,
                     sliding_window or getattr(module, "sliding_window", None), softcap)
    return out.to(query.dtype), None


class SimulatedKV(AttentionRoute):
    """Route a model's attention through :meth:`attend`, which reads K/V as ``scheme`` stores
    them (per query position: sink and recent window in BF16, the rest INT2). Sets and restores
    the attention implementation of every config of the model, also on error.

    >>> with SimulatedKV(model, scheme):
    ...     logits = model(ids).logits
    """

    name = SIM_NAME
    active = _ACTIVE

    def __init__(self, model, scheme: KVScheme):
        self.model, self.scheme = model, scheme

    def __enter__(self) -> "SimulatedKV":
        from transformers import AttentionInterface

        AttentionInterface.register(SIM_NAME, _sim_attention)
        return self._route("sdpa")

    @staticmethod
    def _allowed(mask, b: int, t: int, s: int, window: int | None, device) -> torch.Tensor:
        """Boolean [B|1, 1, T, S]: the model's mask, or causal (+ sliding window) when it is None."""
        if mask is None:
            qpos = torch.arange(t, device=device).unsqueeze(1) + (s - t)
            kpos = torch.arange(s, device=device).unsqueeze(0)
            m = kpos <= qpos
            if window:
                m &= qpos - kpos < window
            return m.view(1, 1, t, s)
        if mask.dtype == torch.bool:
            return mask[..., -s:]
        return (mask > torch.finfo(mask.dtype).min / 2)[..., -s:]

    def attend(self, layer: int, q, k, v, mask, scaling: float, window: int | None, softcap) -> torch.Tensor:
        """q [B, Hq, T, d], k/v [B, Hkv, S, d] -> attention output [B, T, Hq, d] (float32).

        Exact per-(i, j) selection with one attention call: the keys are the INT2 version
        rotated back (``K̂Rᵀ``, so ``q·(K̂Rᵀ)ᵀ = (qR)·K̂ᵀ``) followed by the BF16 version, values
        likewise, and the mask lets row ``i`` read column ``j`` of the BF16 half when
        ``j < sink`` or ``i − j < recent`` and of the INT2 half otherwise (both within the
        model's own mask). The softmax over the ``2S`` columns is then the softmax over the
        ``S`` keys each read in the right precision, and ``P·V`` sums each part."""
        from .kernels import quantize_kv

        sch = self.scheme
        b, hq, t, d = q.shape
        hkv, s = k.shape[1], k.shape[2]
        grp = hq // hkv
        allowed = self._allowed(mask, b, t, s, window, q.device)                          # [B|1, 1, T, S]
        wd = sch.window_dtype
        k_in = k.to(wd) if wd is not None else k
        v_in = v.to(wd) if wd is not None else v
        keys, values = k_in.float(), v_in.float()
        if sch.quantized:
            rk, ck, rv, cv = (None if x is None else x.to(q.device, torch.float32) for x in sch.layer(layer))
            kq = quantize_kv(k_in.transpose(1, 2), rk, ck, sch.group_size).dequantize()     # [B, S, Hkv, d] rotated
            vq = quantize_kv(v_in.transpose(1, 2), rv, cv, sch.group_size).dequantize()
            k_lo = torch.einsum("bshe,hde->bhsd", kq, rk) if rk is not None else kq.transpose(1, 2)
            v_lo = torch.einsum("bshe,hde->bhsd", vq, rv) if rv is not None else vq.transpose(1, 2)
            qpos = torch.arange(t, device=q.device).unsqueeze(1) + (s - t)
            kpos = torch.arange(s, device=q.device).unsqueeze(0)
            hi = (kpos < sch.sink) | (qpos - kpos < sch.recent)                             # [T, S]
            keys = torch.cat([k_lo, keys], dim=2)
            values = torch.cat([v_lo, values], dim=2)
            allowed = torch.cat([allowed & ~hi, allowed & hi], dim=-1)                     # [B|1, 1, T, 2S]
        keys, values = keys.repeat_interleave(grp, 1), values.repeat_interleave(grp, 1)
        qf = q.float()
        if not softcap:
            o = torch.nn.functional.scaled_dot_product_attention(qf, keys, values, attn_mask=allowed, scale=scaling)
            return o.transpose(1, 2)
        sc = (qf @ keys.transpose(-1, -2)) * scaling
        sc = torch.tanh(sc / softcap) * softcap
        p = torch.softmax(sc.masked_fill(~allowed, -math.inf), dim=-1)
        return (p @ values).transpose(1, 2)


# ----------------------------------------------------------------------------- perplexity

def heldout_sequences(tokenizer, *, sequences: int = 2, seq_len: int = 2048, data: str = "embedded",
                      seed: int = 0) -> list[torch.Tensor]:
    """``sequences`` windows of ``seq_len`` tokens from the held-out half of the embedded corpus
    (or from ``data``), chosen by ``seed``."""
    from .corpus import plan_tokens

    plan = plan_tokens(tokenizer, data=data, tokens=seq_len, seq_len=seq_len, heldout_tokens=seq_len,
                       heldout_seqs=sequences, seed=seed, corpus_split="heldout")
    return plan.heldout


def _decoder_and_head(model):
    dec = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings()
    from .models import text_config

    cap = getattr(text_config(model.config), "final_logit_softcapping", None)
    return dec, head, cap


def _nll_from_hidden(model, hidden: torch.Tensor, targets: torch.Tensor, chunk: int = 256) -> float:
    """Σ −log p(target) over positions, with the LM head applied in chunks (Gemma's vocabulary
    is 262K: full logits of 2K tokens would be 2 GB)."""
    _, head, cap = _decoder_and_head(model)
    total = 0.0
    for a in range(0, hidden.shape[1], chunk):
        logits = head(hidden[:, a:a + chunk]).float()
        if cap:
            logits = torch.tanh(logits / cap) * cap
        lp = torch.log_softmax(logits, dim=-1)
        total -= float(lp.gather(-1, targets[:, a:a + chunk].unsqueeze(-1)).sum())
    return total


@torch.no_grad()
def sequence_nll(model, ids: torch.Tensor, scheme: KVScheme | None = None) -> tuple[float, int]:
    """Sum of teacher-forced NLL over ``ids`` [1, T] (T − 1 predictions) with K/V read as
    ``scheme`` stores them (None: the model's own attention)."""
    dev = next(model.parameters()).device
    ids = ids.to(dev)
    dec, _, _ = _decoder_and_head(model)
    if scheme is None:
        hidden = dec(input_ids=ids, use_cache=False).last_hidden_state
    else:
        with SimulatedKV(model, scheme):
            hidden = dec(input_ids=ids, use_cache=False).last_hidden_state
    return _nll_from_hidden(model, hidden[:, :-1], ids[:, 1:]), ids.shape[1] - 1


def quanto_cache(config):
    """transformers' ``QuantizedCache`` (optimum-quanto backend, 2 bits, its default residual
    length and group size). For models with sliding-window layers, which ``QuantizedCache``
    refuses, every layer is a ``QuantoQuantizedLayer`` keeping all tokens (the mask applies the
    window)."""
    try:
        import optimum.quanto  # noqa: F401
    except ImportError:
        raise InputError("method 'quanto' needs optimum-quanto: pip install 'oscar-calib[quanto]'") from None
    from transformers.cache_utils import Cache, QuantizedCache, QuantoQuantizedLayer

    cfg = config.get_text_config(decoder=True)
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    if all(t == "full_attention" for t in types):
        return QuantizedCache(backend="quanto", config=cfg, nbits=QUANTO_DEFAULTS["nbits"])
    return Cache(layers=[QuantoQuantizedLayer(nbits=QUANTO_DEFAULTS["nbits"]) for _ in types])


@torch.no_grad()
def quanto_sequence_nll(model, ids: torch.Tensor, progress=None, make_cache=None) -> tuple[float, int]:
    """Teacher-forced NLL decoding ``ids`` token by token through a quanto ``QuantizedCache``
    (or the cache ``make_cache(config)`` returns: a lossless one checks the loop itself)."""
    dev = next(model.parameters()).device
    ids = ids.to(dev)
    cache = (make_cache or quanto_cache)(model.config)
    dec, _, _ = _decoder_and_head(model)
    total, n = 0.0, ids.shape[1] - 1
    for t in range(n):
        h = dec(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).last_hidden_state
        total += _nll_from_hidden(model, h, ids[:, t + 1:t + 2])
        if progress and t % 256 == 0:
            progress(t, n)
    return total, n


# ----------------------------------------------------------------------------- results

@dataclass
class EvalResult:
    task: str
    model_id: str
    settings: dict
    rows: list[dict]
    timings: dict = field(default_factory=dict)

    def summary(self) -> list[dict]:
        """ppl: one row per method; niah: one row per method with accuracy per length."""
        if self.task == "ppl":
            return self.rows
        out = []
        for m in dict.fromkeys(r["method"] for r in self.rows):
            rs = [r for r in self.rows if r["method"] == m]
            by_len = {}
            for r in rs:
                by_len.setdefault(r["length"], []).append(r["score"])
            out.append({"method": m, "accuracy": sum(r["score"] for r in rs) / len(rs), "samples": len(rs),
                        "by_length": {str(k): sum(v) / len(v) for k, v in sorted(by_len.items())},
                        "bits_per_element": rs[0]["bits_per_element"]})
        return out

    def to_json(self) -> dict:
        return {"task": self.task, "model_id": self.model_id, "settings": self.settings, "summary": self.summary(),
                "rows": self.rows, "timings": self.timings}


def evaluate_ppl(lm, methods: list[str], *, artifact=None, group_size: int | None = None, sink: int = DEFAULT_SINK,
                 recent: int = DEFAULT_RECENT, sequences: int = 2, seq_len: int = 2048, data: str = "embedded",
                 seed: int = 0, progress=None) -> EvalResult:
    """Held-out perplexity of every method (see the module docstring)."""
    t0 = time.perf_counter()
    schemes = build_schemes(methods, lm.geometry, artifact=artifact, group_size=group_size, sink=sink, recent=recent)
    seqs = heldout_sequences(lm.tokenizer, sequences=sequences, seq_len=seq_len, data=data, seed=seed)
    rows, timings = [], {}
    for m in methods:
        t1 = time.perf_counter()
        nll = n = 0
        for i, s in enumerate(seqs):
            if progress:
                progress(f"{m}: sequence {i + 1}/{len(seqs)}")
            if m == "quanto":
                a, b = quanto_sequence_nll(lm.model, s.unsqueeze(0),
                                           progress=(lambda d, tot: progress(f"quanto: sequence {i + 1}/{len(seqs)}, "
                                                                            f"token {d}/{tot}")) if progress else None)
            else:
                a, b = sequence_nll(lm.model, s.unsqueeze(0), schemes[m])
            nll, n = nll + a, n + b
        sch = schemes.get(m)
        rows.append({"method": m, "ppl": math.exp(nll / n), "nll": nll / n, "tokens": n,
                     "bits_per_element": bits_of(m, sch),
                     "group_size": QUANTO_DEFAULTS["q_group_size"] if m == "quanto" else (sch.group_size if sch else None)})
        timings[m] = time.perf_counter() - t1
    by = {r["method"]: r["ppl"] for r in rows}
    for r in rows:   # share of the Hadamard → BF16 gap this method closes
        if "bf16" in by and "hadamard" in by and by["hadamard"] != by["bf16"]:
            r["gap_closed_vs_hadamard"] = (by["hadamard"] - r["ppl"]) / (by["hadamard"] - by["bf16"])
    settings = {"methods": methods, "sink": sink, "recent": recent, "sequences": len(seqs), "seq_len": seq_len,
                "data": "embedded:pydoc_data.topics[heldout]" if data == "embedded" else data, "seed": seed, "group_size": next((s.group_size for s in schemes.values() if s.quantized),
                                                               group_size),
                "artifact": str(artifact.path) if artifact is not None and artifact.path else None,
                "quanto": dict(QUANTO_DEFAULTS) if "quanto" in methods else None}
    timings["total_s"] = time.perf_counter() - t0
    return EvalResult("ppl", lm.source.model_id, settings, rows, timings)


# ----------------------------------------------------------------------------- needle in a haystack

NIAH_PREFIX = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the numbers afterwards.\n")
NIAH_NEEDLE = "One of the special magic numbers for {key} is: {value}."
NIAH_QUESTION = ("\nWhat is the special magic number for {key} mentioned in the provided text? "
                 "The special magic number for {key} mentioned in the provided text is")
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_ADJECTIVES = ("ancient", "bright", "calm", "daring", "eager", "fancy", "gentle", "hollow", "icy", "jolly", "keen",
               "lively", "mellow", "noble", "odd", "proud", "quiet", "rapid", "silent", "tidy", "vivid", "witty")
_NOUNS = ("anchor", "badge", "cabinet", "dolphin", "engine", "falcon", "garden", "harbor", "island", "jacket",
          "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quartz", "river", "saddle", "tunnel",
          "violin", "window")
HAYSTACKS = ("corpus", "noise")


@dataclass
class NiahSample:
    ids: list[int]
    key: str
    value: str
    length: int          # the requested length; len(ids) is the real one
    depth: float
    seed: int
    needle_at: int       # token offset of the needle in ids (approximate, from the sentence split)


_SENTENCES: dict = {}


def _filler_sentences(tokenizer, haystack: str) -> tuple[list[str], list[int]]:
    """Sentences of the embedded corpus' held-out half (or RULER's noise), with token counts."""
    key = (id(tokenizer), haystack)
    if key not in _SENTENCES:
        if haystack == "noise":
            sents = [s + "." for s in NOISE.rstrip(".").split(". ")]
        elif haystack == "corpus":
            from .corpus import embedded_texts

            text = "\n".join(embedded_texts())
            text = text[len(text) // 2:]
            sents = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if 20 <= len(s.strip()) <= 600]
        else:
            raise InputError(f"unknown haystack {haystack!r}; choose from {', '.join(HAYSTACKS)}")
        lens = [len(tokenizer(" " + s, add_special_tokens=False)["input_ids"]) for s in sents]
        _SENTENCES[key] = (sents, lens)
    return _SENTENCES[key]


def make_niah(tokenizer, length: int, depth: float, seed: int, *, haystack: str = "corpus") -> NiahSample:
    """One RULER-style needle-in-a-haystack prompt of about ``length`` tokens with the needle at
    ``depth`` (0 = start, 1 = end of the filler). Deterministic for (tokenizer, length, depth,
    seed, haystack)."""
    if not 0.0 <= depth <= 1.0:
        raise InputError(f"depth {depth} is outside [0, 1]")
    rng = random.Random(f"niah:{seed}:{length}:{depth:.4f}")
    key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
    value = str(rng.randint(1_000_000, 9_999_999))
    sents, lens = _filler_sentences(tokenizer, haystack)
    tok = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    needle = NIAH_NEEDLE.format(key=key, value=value)
    fixed = len(tok(NIAH_PREFIX)) + len(tok(NIAH_QUESTION.format(key=key))) + len(tok(" " + needle)) + 2
    budget = length - fixed
    if budget < 16:
        raise InputError(f"NIAH length {length} is too short for the template ({fixed} tokens)")
    start = rng.randrange(len(sents))
    chosen, total, i = [], 0, start
    while total < budget:
        s, n = sents[i % len(sents)], lens[i % len(sents)]
        if total + n > budget:
            break
        chosen.append(s)
        total += n
        i += 1
    at = 0
    acc = 0
    while at < len(chosen) and acc + lens[(start + at) % len(sents)] <= depth * total:
        acc += lens[(start + at) % len(sents)]
        at += 1
    parts = chosen[:at] + [needle] + chosen[at:]
    text = NIAH_PREFIX + " ".join(parts) + NIAH_QUESTION.format(key=key)
    ids = tok(text)
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and getattr(tokenizer, "add_bos_token", False) and (not ids or ids[0] != bos):
        ids = [bos] + ids
    return NiahSample(ids, key, value, length, depth, seed, len(tok(NIAH_PREFIX)) + acc)


def score_niah(answer: str, value: str) -> int:
    """1 when the first number in ``answer`` (digits, thousands separators ignored) equals
    ``value``, else 0."""
    m = re.search(r"\d[\d,]*", answer)
    return int(bool(m) and m.group(0).replace(",", "") == value)


def _prefill(model, ids: torch.Tensor, chunk: int):
    """Full-precision prefill of ``ids`` [1, T] into a config-less ``DynamicCache`` (every layer
    keeps every token, so any method's cache can be built from it)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for a in range(0, ids.shape[1], chunk):
        model(input_ids=ids[:, a:a + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def cache_for(method: str, model, prefill, scheme: KVScheme | None):
    """A fresh cache for ``method`` holding the prefilled tokens exactly as that method stores
    them (the prefill itself attended in full precision, as serving engines do)."""
    if method == "bf16":
        return copy.deepcopy(prefill)
    cache = quanto_cache(model.config) if method == "quanto" else OscarCache(model.config, scheme)
    for i, layer in enumerate(prefill.layers):
        cache.layers[i].update(layer.keys, layer.values)
    return cache


@torch.no_grad()
def evaluate_niah(lm, methods: list[str], *, artifact=None, group_size: int | None = None, sink: int = DEFAULT_SINK,
                  recent: int = DEFAULT_RECENT, lengths=(1024, 2048, 4096, 8192), depths=(0.0, 0.25, 0.5, 0.75, 1.0),
                  samples: int = 1, seed: int = 0, haystack: str = "corpus", max_new_tokens: int = 12,
                  prefill_chunk: int = 2048, progress=None) -> EvalResult:
    """NIAH accuracy of every method (see the module docstring)."""
    t0 = time.perf_counter()
    model, tok = lm.model, lm.tokenizer
    schemes = build_schemes(methods, lm.geometry, artifact=artifact, group_size=group_size, sink=sink, recent=recent)
    max_ctx = getattr(lm.model.config.get_text_config(), "max_position_embeddings", None)
    if max_ctx and max(lengths) > max_ctx:
        raise InputError(f"NIAH length {max(lengths)} exceeds the model's context ({max_ctx})")
    dev = next(model.parameters()).device
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    rows = []
    jobs = [(L, d, s) for L in lengths for d in depths for s in range(samples)]
    for n, (length, depth, s) in enumerate(jobs):
        sample = make_niah(tok, length, depth, seed + s, haystack=haystack)
        ids = torch.tensor([sample.ids], device=dev)
        if progress:
            progress(f"NIAH {n + 1}/{len(jobs)}: length {length}, depth {depth:.2f}: prefill")
        pre = _prefill(model, ids[:, :-1], prefill_chunk)
        for m in methods:
            if progress:
                progress(f"NIAH {n + 1}/{len(jobs)}: length {length}, depth {depth:.2f}: {m}")
            cache = cache_for(m, model, pre, schemes.get(m))
            out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                 max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
            answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            row = {"method": m, "length": length, "tokens": ids.shape[1], "depth": depth, "seed": seed + s,
                   "key": sample.key, "expected": sample.value, "answer": answer.strip()[:60],
                   "score": score_niah(answer, sample.value), "bits_per_element": bits_of(m, schemes.get(m))}
            if isinstance(cache, OscarCache):
                row["cache_bytes_per_token"] = cache.memory()["bytes_per_token"]
            rows.append(row)
        del pre
    settings = {"methods": methods, "sink": sink, "recent": recent, "lengths": list(lengths), "depths": list(depths),
                "samples": samples, "seed": seed, "haystack": haystack, "max_new_tokens": max_new_tokens,
                "group_size": next((s.group_size for s in schemes.values() if s.quantized), group_size),
                "artifact": str(artifact.path) if artifact is not None and artifact.path else None}
    return EvalResult("niah", lm.source.model_id, settings, rows, {"total_s": time.perf_counter() - t0})


# ----------------------------------------------------------------------------- entry point and plot

def run_eval(model: str, artifact_path: Path | None, *, task: str = "ppl", methods="bf16,naive,hadamard,oscar,quanto",
             loaded=None, device: str = "auto", dtype: str = "auto", plot: Path | None = None, **kw) -> EvalResult:
    """Load the model (and artifact), run ``task`` and write the plot. Used by ``oscar eval``."""
    from .artifact import load_artifact
    from .config import CalibrationConfig
    from .pipeline import prepare_model

    if task not in TASKS:
        raise InputError(f"unknown --task {task!r}; choose from {', '.join(TASKS)}")
    ms = parse_methods(methods)
    if artifact_path is None and "oscar" in ms:
        ms = [m for m in ms if m != "oscar"]
        if not ms:
            raise InputError("method 'oscar' needs an ARTIFACT")
    art = load_artifact(Path(artifact_path)) if artifact_path is not None else None
    lm = loaded or prepare_model(CalibrationConfig(model=model, device=device, dtype=dtype))
    if art is not None:
        from .verify import check_artifact_matches

        check_artifact_matches(art, lm.geometry, lm.fingerprint)
    fn = evaluate_ppl if task == "ppl" else evaluate_niah
    result = fn(lm, ms, artifact=art, **kw)
    if plot is not None:
        write_plot(Path(plot), result)
        result.settings["plot"] = str(plot)
    return result


def eval_text(results: dict) -> str:
    """Plain-text tables of recorded results (``{task: EvalResult.to_json()}``), for model cards."""
    lines = []
    ppl = results.get("ppl")
    if ppl:
        s = ppl["settings"]
        lines.append(f"held-out perplexity: {s['sequences']} x {s['seq_len']} tokens of {s['data']}, "
                     f"BF16 sink {s['sink']} + recent {s['recent']} per query position, INT2 history")
        lines.append(f"{'method':<10}{'bits/elem':>10}{'group':>7}{'perplexity':>12}{'gap closed':>12}")
        for r in ppl["rows"]:
            gap = f"{r['gap_closed_vs_hadamard']:+.0%}" if "gap_closed_vs_hadamard" in r else "-"
            lines.append(f"{r['method']:<10}{r['bits_per_element']:>10.3f}{str(r['group_size'] or '-'):>7}"
                         f"{r['ppl']:>12.3f}{gap:>12}")
        lines.append("gap closed: share of the Hadamard -> BF16 perplexity gap closed; quanto: transformers "
                     "QuantizedCache (2 bits, residual 128, group 64)")
    niah = results.get("niah")
    if niah:
        s = niah["settings"]
        if lines:
            lines.append("")
        lengths = list(niah["summary"][0]["by_length"]) if niah["summary"] else []
        lines.append(f"needle in a haystack (exact match): depths {s['depths']}, {s['samples']} sample(s) each, "
                     f"haystack {s['haystack']}, generate() through the cache")
        lines.append(f"{'method':<10}{'bits/elem':>10}" + "".join(f"{k:>8}" for k in lengths) + f"{'all':>8}")
        for r in niah["summary"]:
            lines.append(f"{r['method']:<10}{r['bits_per_element']:>10.3f}"
                         + "".join(f"{r['by_length'][k]:>8.2f}" for k in lengths) + f"{r['accuracy']:>8.2f}")
    return "\n".join(lines)


def eval_headline(results: dict) -> dict:
    """The few numbers a model card and the zoo table show: perplexity of every method,
    the artifact's bits per element, and NIAH accuracy per method (nested)."""
    out: dict = {}
    ppl = results.get("ppl")
    if ppl:
        for r in ppl["rows"]:
            out[f"{r['method']}_ppl"] = round(r["ppl"], 3)
            if r["method"] == "oscar":
                out["oscar_bits_per_element"] = r["bits_per_element"]
    niah = results.get("niah")
    if niah:
        out["niah"] = {r["method"]: round(r["accuracy"], 3) for r in niah["summary"]}
        out["niah"]["lengths"] = niah["settings"]["lengths"]
    return out


def record_eval(artifact_dir: Path, result: EvalResult) -> None:
    """Store ``result`` in the artifact's ``calibration.json``: the full result under
    ``eval_results[task]`` (plus ``eval_results["text"]``, the tables as text) and the headline
    numbers under ``eval`` (what the model card and ``oscar zoo`` show); then rewrite the model
    card. The rotations file is not touched."""
    import json

    from .artifact import CARD_NAME, REPORT_NAME, atomic_write_text
    from .card import model_card

    directory = Path(artifact_dir)
    path = directory / REPORT_NAME
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"cannot record the evaluation: {path} is not readable ({e})") from None
    results = report.setdefault("eval_results", {})
    results[result.task] = result.to_json()
    results["text"] = eval_text(results)
    report["eval"] = eval_headline(results)
    atomic_write_text(path, json.dumps(report, indent=2, sort_keys=True) + "\n")
    atomic_write_text(directory / CARD_NAME, model_card(report))


def write_plot(path: Path, result: EvalResult) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .artifact import atomic_write_bytes

    if result.task == "ppl":
        fig, ax = plt.subplots(figsize=(6.5, 3.6), constrained_layout=True)
        rows = result.rows
        names = [f"{r['method']}\n{r['bits_per_element']:.2f} b" for r in rows]
        vals = [r["ppl"] for r in rows]
        bars = ax.bar(names, vals, color=["#888" if r["method"] == "bf16" else "#c55" if r["method"] == "oscar"
                                          else "#58a" for r in rows])
        for bar, v in zip(bars, vals):
            ax.annotate(f"{v:.2f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("held-out perplexity (log)")
        ax.set_title(f"{result.model_id}: sink {result.settings['sink']} + recent {result.settings['recent']} BF16, "
                     f"group {result.settings['group_size']}", fontsize=9)
    else:
        fig, ax = plt.subplots(figsize=(6.5, 3.6), constrained_layout=True)
        for s in result.summary():
            xs = [int(k) for k in s["by_length"]]
            ax.plot(xs, list(s["by_length"].values()), "o-", label=s["method"])
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("NIAH exact match")
        ax.set_title(f"{result.model_id}: needle retrieval through the KV cache", fontsize=9)
        ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buf.getvalue())
