"""Needle in a haystack (RULER's ``niah_single`` style) through ``model.generate``.

A needle "One of the special magic numbers for {key} is: {value}." (a random word pair and a
7-digit number) is placed at several depths of filler text (held-out corpus sentences, or RULER's
repeated "noise" sentences), followed by the question. The prompt (all but its last token) is
prefilled once in full precision, as a serving engine prefills; each method's cache is built from
that prefill (INT2 history written exactly as :class:`~oscar_calib.runtime.cache.OscarCache`
writes it), and ``model.generate`` answers greedily from the last prompt token, so every answer
token, the first included, is decoded through the method's cache. Score: 1 when the first number
in the answer equals the value, else 0.
"""

from __future__ import annotations

import copy
import hashlib
import random
import re
import time
from dataclasses import dataclass

import torch

from ..errors import InputError
from ..model.placement import input_device
from ..progress import ProgressFn, counter
from ..runtime.cache import OscarCache, attached
from ..runtime.scheme import KVScheme
from .methods import bits_of, build_schemes, fork_settings, quanto_cache
from .options import HAYSTACKS, EvalOptions, options_for
from .report import EvalResult

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


def filler_text(haystack: str) -> str:
    """The text filler sentences come from: RULER's noise, generated prose (:mod:`.haystack`), or the
    embedded corpus' held-out half."""
    if haystack == "noise":
        return NOISE
    if haystack == "prose":
        from .haystack import prose_text

        return prose_text()
    if haystack == "corpus":
        from ..data.corpus import embedded_texts

        text = "\n".join(embedded_texts())
        return text[len(text) // 2:]
    raise InputError(f"unknown haystack {haystack!r}; choose from {', '.join(HAYSTACKS)}")


def _filler_sentences(tokenizer, haystack: str) -> tuple[list[str], list[int]]:
    """Sentences of the embedded corpus' held-out half (or RULER's noise), with token counts."""
    key = (id(tokenizer), haystack)
    if key not in _SENTENCES:
        text = filler_text(haystack)
        if haystack == "noise":
            sents = [s + "." for s in text.rstrip(".").split(". ")]
        else:
            sents = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if 20 <= len(s.strip()) <= 600]
        lens = [len(tokenizer(" " + s, add_special_tokens=False)["input_ids"]) for s in sents]
        _SENTENCES[key] = (sents, lens)
    return _SENTENCES[key]


def haystack_fingerprint(haystack: str) -> str:
    """sha256 (first 16 hex digits) of the filler text: the ``corpus`` haystack is the running
    Python's ``pydoc_data`` topics, so two machines' prompts agree only when this does (``prose``
    is the same everywhere)."""
    return hashlib.sha256(filler_text(haystack).encode("utf-8")).hexdigest()[:16]


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
    """Full-precision prefill of ``ids`` [1, T] into a cache whose attention layers keep every token
    (a config-less ``DynamicCache``; a hybrid's keeps its recurrent states beside them:
    :func:`~oscar_calib.runtime.compat.full_cache`), so any method's cache can be built from it."""
    from transformers import DynamicCache

    from ..runtime.compat import cache_slots, full_cache

    hybrid = any(slot.state is not None for slot in cache_slots(model.config))
    cache = full_cache(model.config) if hybrid else DynamicCache()
    for a in range(0, ids.shape[1], chunk):
        model(input_ids=ids[:, a:a + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def cache_for(method: str, model, prefill, scheme: KVScheme | None):
    """A fresh cache for ``method`` holding the prefilled tokens exactly as that method stores
    them (the prefill itself attended in full precision, as serving engines do). INT2 methods get
    the real :class:`OscarCache` (generate inside ``attached(cache, model)``)."""
    if method == "bf16":
        return copy.deepcopy(prefill)
    if method != "quanto":
        return OscarCache(model.config, scheme).prefill_from(prefill)
    cache = quanto_cache(model.config)
    for i, layer in enumerate(prefill.layers):
        cache.layers[i].update(layer.keys, layer.values)
    return cache


@torch.no_grad()
def evaluate_niah(lm, options: EvalOptions | None = None, *, artifact=None, progress: ProgressFn | None = None,
                  graph: bool = False, extra_schemes: dict[str, KVScheme] | None = None) -> EvalResult:
    """NIAH accuracy of every method of ``options`` (see the module docstring); ``progress`` hears
    one stage counting answers (prompts × methods). ``graph``: the INT2 methods' answers decode
    through :func:`~oscar_calib.runtime.graph.graph_decoding` (a CUDA graph per answer; the same
    tokens, fewer host launches) where the model sits on one GPU. ``extra_schemes``: more methods by
    name, each an INT2 scheme of the real cache (e.g. a second artifact's), answering the same prompts."""
    t0 = time.perf_counter()
    o = options_for(options, "niah")
    methods, group_size, sink, recent, seed = list(o.methods), o.group_size, o.sink, o.recent, o.seed
    lengths, depths, samples, haystack = o.lengths, o.depths, o.samples, o.haystack
    max_new_tokens, prefill_chunk = o.max_new_tokens, o.prefill_chunk
    model, tok = lm.model, lm.tokenizer
    schemes = build_schemes(methods, lm.geometry, artifact=artifact, group_size=group_size, sink=sink, recent=recent,
                            real_cache=True, logit_correction=o.logit_correction)
    for name, sch in (extra_schemes or {}).items():
        if name in schemes:
            raise InputError(f"extra NIAH method {name!r} is already one of the methods")
        schemes[name] = sch
        methods.append(name)
    max_ctx = getattr(lm.model.config.get_text_config(), "max_position_embeddings", None)
    if max_ctx and max(lengths) > max_ctx:
        raise InputError(f"NIAH length {max(lengths)} exceeds the model's context ({max_ctx})")
    dev = input_device(model)     # a spread model: where its inputs go
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    rows = []
    from ..runtime.graph import graph_decoding, graph_device

    on_graph = graph and graph_device(model) is not None
    jobs = [(L, d, s) for L in lengths for d in depths for s in range(samples)]
    tick = counter(progress, "needle in a haystack", len(jobs) * len(methods), "answers")
    for length, depth, s in jobs:
        sample = make_niah(tok, length, depth, seed + s, haystack=haystack)
        ids = torch.tensor([sample.ids], device=dev)
        pre = _prefill(model, ids[:, :-1], prefill_chunk)
        for m in methods:
            cache = cache_for(m, model, pre, schemes.get(m))
            how = {"custom_generate": graph_decoding} if on_graph and isinstance(cache, OscarCache) else {}
            with attached(cache, model):
                out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                     max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad, **how)
            answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            row = {"method": m, "length": length, "tokens": ids.shape[1], "depth": depth, "seed": seed + s,
                   "key": sample.key, "expected": sample.value, "answer": answer.strip()[:60],
                   "score": score_niah(answer, sample.value), "bits_per_element": bits_of(m, schemes.get(m))}
            if isinstance(cache, OscarCache):
                row["cache_bytes_per_token"] = cache.memory()["bytes_per_token"]
            rows.append(row)
            tick(len(rows))
        del pre
    settings = {"methods": methods, "sink": sink, "recent": recent, "lengths": list(lengths), "depths": list(depths),
                "samples": samples, "seed": seed, "haystack": haystack,
                "haystack_sha256": haystack_fingerprint(haystack), "max_new_tokens": max_new_tokens,
                "decoding": "graph" if on_graph else "eager",
                "group_size": next((s.group_size for s in schemes.values() if s.quantized), group_size),
                "artifact": str(artifact.path) if artifact is not None and artifact.path else None}
    corrections = {m: s.logit_correction for m, s in schemes.items() if s.logit_correction}
    if corrections:
        settings["logit_correction"] = corrections
    fork = fork_settings(schemes, artifact)
    if fork:
        settings["fork"] = fork | {"quantizer": "oscar (the real INT2 cache: fp16 scale/offset)"}
    return EvalResult("niah", lm.source.model_id, settings, rows, {"total_s": time.perf_counter() - t0})
