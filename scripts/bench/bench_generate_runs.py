"""Measurements for ``scripts/bench/bench_generate.py``: the model, the caches filled with random K/V,
eager decode through ``generate()``, GPU busy time (profiler), CUDA-graph replay, time to first
token and the largest context that fits."""

from __future__ import annotations

import functools
import gc
import time

import torch
from harness import graph_ms as _graph_ms

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1e6)
QUICK = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=512, rope_theta=1e6)


def build_model(quick: bool, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3", max_position_embeddings=1 << 23, **(QUICK if quick else QWEN3_8B))
    cfg.eos_token_id = None
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model.eval().requires_grad_(False)
    model.config._attn_implementation = "sdpa"
    return model


def oscar_scheme(cfg, group_size: int, window: tuple[int, int] = (64, 256)):
    """Random orthogonal K rotations, clips 0.96 / 0.92, V folded (no V rotation); ``window``: sink, recent."""
    return _scheme(cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers, group_size, window)


@functools.lru_cache(maxsize=4)
def _scheme(h: int, d: int, n: int, group_size: int, window: tuple[int, int]):
    from oscar_calib.kernels.testing import random_rotation
    from oscar_calib.runtime import KVScheme

    g = torch.Generator().manual_seed(0)
    rk = [random_rotation(h, d, generator=g) for _ in range(n)]
    ck, cv = torch.full((h,), 0.96), torch.full((h,), 0.92)
    return KVScheme("oscar", n, group_size, rk, [None] * n, [ck] * n, [cv] * n, sink=window[0], recent=window[1])


def _rand(shape, device, dtype):
    return torch.randn(shape, device=device, dtype=dtype)


def make_cache(kind: str, model, batch: int, tokens: int, extra: int, args):
    """A cache of ``kind`` holding ``tokens`` random tokens per sequence (filled layer by layer)."""
    from transformers import DynamicCache, StaticCache

    cfg, dev, dt = model.config, model.device, model.dtype
    h, d = cfg.num_key_value_heads, cfg.head_dim
    if kind == "oscar":
        from oscar_calib.runtime import OscarCache

        cache = OscarCache(cfg, oscar_scheme(cfg, args.group_size, args.window))
        cache.reserve(tokens + extra)
        for layer in cache.layers:
            for a in range(0, tokens, args.fill_chunk):
                n = min(args.fill_chunk, tokens - a)
                layer.write_prefix(_rand((batch, h, n, d), dev, dt), _rand((batch, h, n, d), dev, dt))
        return cache
    if kind == "static":
        cache = StaticCache(config=cfg, max_cache_len=tokens + extra)
        for layer in cache.layers:
            layer.lazy_initialization(_rand((batch, h, 1, d), dev, dt), _rand((batch, h, 1, d), dev, dt))
            layer.keys[:, :, :tokens].normal_()
            layer.values[:, :, :tokens].normal_()
            layer.cumulative_length.fill_(tokens)
        return cache
    if kind == "quantized":
        from transformers import QuantizedCache

        cache = QuantizedCache(backend="quanto", config=cfg, nbits=2)
    else:
        cache = DynamicCache(config=cfg)
    for layer in cache.layers:
        layer.update(_rand((batch, h, tokens, d), dev, dt), _rand((batch, h, tokens, d), dev, dt))
    return cache


def _attached(cache, model):
    from oscar_calib.runtime.cache import attached

    return attached(cache, model)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def decode(model, cache, batch: int, tokens: int, new: int) -> dict:
    """``generate`` ``new`` tokens after the cached context; wall tokens/s and peak memory."""
    dev = model.device
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens + 1), device=dev)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    _sync(dev)
    t0 = time.perf_counter()
    with _attached(cache, model), torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
    _sync(dev)
    wall = time.perf_counter() - t0
    assert out.shape[1] == tokens + 1 + new
    res = {"wall_s": wall, "tok_s": batch * new / wall, "ms_per_step": 1e3 * wall / new}
    if dev.type == "cuda":
        res.update(peak_gib=torch.cuda.max_memory_allocated() / 2**30, before_decode_gib=base / 2**30)
    return res


def _step(model, cache, batch: int, pos: int):
    ids = torch.zeros(batch, 1, dtype=torch.long, device=model.device)
    posid = torch.full((batch, 1), pos, dtype=torch.long, device=model.device)
    return lambda: model(input_ids=ids, position_ids=posid, past_key_values=cache, use_cache=True, logits_to_keep=1)


def busy_ms(model, cache, batch: int, tokens: int, steps: int = 6) -> float | None:
    """GPU busy time per decode step (sum of kernel times over eager steps, torch profiler)."""
    if model.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    step = _step(model, cache, batch, tokens)
    with _attached(cache, model), torch.no_grad():
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
    total = 0.0
    for e in prof.key_averages():
        total += getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
    return total / 1e3 / steps


def graph_ms(model, cache, batch: int, tokens: int, replays: int = 20) -> float | None:
    """GPU time per decode step replayed from a CUDA graph (static buffers on both sides; median of
    ``replays``, L2 warm: ``harness.graph_ms``)."""
    if model.device.type != "cuda":
        return None
    step = _step(model, cache, batch, tokens)
    with _attached(cache, model), torch.no_grad():
        return _graph_ms(step, cuda=True, flush="none", warmup=2, reps=replays)


def graph_decode(model, batch: int, tokens: int, new: int, args, compile: bool = False) -> dict:
    """Wall tokens/s of a greedy loop through :class:`~oscar_calib.runtime.DecodeGraph` (argmax and
    host bookkeeping included; the first call runs eagerly, the second records, the rest replay);
    ``compile``: ``DecodeGraph(compile=True)``, whose first two calls also compile (their time: ``graph_setup_s``)."""
    from oscar_calib.runtime import DecodeGraph

    dev = model.device
    cache = make_cache("oscar", model, batch, tokens, new + 8, args)
    tok = torch.zeros(batch, 1, dtype=torch.long, device=dev)
    pos = torch.full((batch, 1), tokens, dtype=torch.long, device=dev)
    with _attached(cache, model), torch.no_grad():
        step = DecodeGraph(model, cache, compile=compile)
        t0 = time.perf_counter()
        for _ in range(2):                             # eager warm-up, then the recording
            tok = step(tok, pos).argmax(-1)
            pos += 1
        _sync(dev)
        setup = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(new):
            tok = step(tok, pos).argmax(-1)
            pos += 1
        _sync(dev)
    wall = time.perf_counter() - t0
    return {"graph_tok_s": batch * new / wall, "graph_wall_ms_per_step": 1e3 * wall / new, "graph_setup_s": setup}


class _Clock:
    """A logits processor that waits for the GPU and reads the clock at its first call (the prompt's
    logits are ready), and changes nothing."""

    def __init__(self):
        self.t0 = None

    def __call__(self, input_ids, scores):
        if self.t0 is None:
            _sync(scores.device)
            self.t0 = time.perf_counter()
        return scores


def generate_rate(model, method: str, batch: int, tokens: int, new: int, args) -> dict:
    """Decode tokens/s of ``model.generate()`` itself after a real prompt of ``tokens`` random ids:
    ``dynamic`` (DynamicCache), ``oscar`` (OscarCache, eager steps), ``oscar+graph``
    (``custom_generate=graph_decoding``) or ``oscar+graph+eos`` (the same with an EOS stop that
    ``min_new_tokens`` keeps from firing: the loop that decides stops on the device) or
    ``oscar+graph+compile`` (``graph_decoding`` with ``compile=True``). After a
    warm-up call, one call of ``new`` tokens, timed from the prompt's logits (a logits processor
    waits for them) to its end: ``new - 1`` decode steps, the graph's recording included."""
    from transformers import DynamicCache, LogitsProcessorList

    from oscar_calib.runtime import graph_decoding

    dev = model.device
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), device=dev,
                        generator=torch.Generator(dev.type).manual_seed(0))
    decoding = functools.partial(graph_decoding, compile=True) if method.endswith("+compile") else graph_decoding
    extra = {"custom_generate": decoding} if method.startswith("oscar+graph") else {}
    for n in (2, new):                                 # (the first call warms up: compiles, allocates)
        cache = (DynamicCache(config=model.config) if method == "dynamic"
                 else make_cache("oscar", model, batch, 0, tokens + new + 8, args))
        clock = _Clock()
        stop = {"eos_token_id": 1, "min_new_tokens": n} if method.endswith("+eos") else {}   # an EOS stop, never hit
        with _attached(cache, model), torch.no_grad():
            out = model.generate(ids, past_key_values=cache, max_new_tokens=n, do_sample=False, pad_token_id=0,
                                 logits_processor=LogitsProcessorList([clock]), **extra, **stop)
        _sync(dev)
        wall = time.perf_counter() - clock.t0
        assert out.shape == (batch, tokens + n)
        del cache, out
    return {"generate_tok_s": batch * (new - 1) / wall, "decode_wall_s": wall}


def ttft(model, kind: str, tokens: int, args) -> dict:
    """Real prefill of ``tokens`` random ids through ``generate(max_new_tokens=1)``, batch 1."""
    from transformers import DynamicCache

    dev = model.device
    cache = make_cache(kind, model, 1, 0, tokens + 8, args) if kind == "oscar" else DynamicCache(config=model.config)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=dev)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    _sync(dev)
    t0 = time.perf_counter()
    with _attached(cache, model), torch.no_grad():
        model.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False, pad_token_id=0)
    _sync(dev)
    res = {"ttft_s": time.perf_counter() - t0}
    if dev.type == "cuda":
        res["prefill_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return res


def kv_bytes_per_token(model, kind: str, group_size: int) -> float:
    c = model.config
    rows = c.num_hidden_layers * 2 * c.num_key_value_heads
    if kind == "oscar":
        return rows * (c.head_dim / 4 + 4 * c.head_dim / group_size)
    return rows * c.head_dim * 2


def max_context(model, kind: str, args) -> dict:
    """Largest context (batch 1) whose cache fits with a 2-token decode, probed downwards from the
    estimate ``free memory / bytes per token``."""
    if model.device.type != "cuda":
        return {}
    free = torch.cuda.mem_get_info()[0] - 3 * 2**30            # room for activations and the graph of a step
    est = int(free / kv_bytes_per_token(model, kind, args.group_size))
    tried = []
    for f in (0.97, 0.9, 0.8, 0.65):
        n = int(est * f) // 1024 * 1024
        cache = None
        try:
            cache = make_cache(kind, model, 1, n, 16, args)
            decode(model, cache, 1, n, 2)
            return {"max_tokens": n, "estimate": est, "tried": tried + [n]}
        except torch.cuda.OutOfMemoryError:
            tried.append(n)
        finally:
            del cache
            gc.collect()
            torch.cuda.empty_cache()
    return {"max_tokens": None, "estimate": est, "tried": tried}
