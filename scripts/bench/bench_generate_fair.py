"""The fair BF16 decode baseline of ``bench_generate.py``, each decode step's roofline, and a
profile of where a step's time goes.

**The baseline.** BF16 at its best at decode is a static BF16 cache whose attention reads only the
tokens it holds, unmasked, one query row per head, the GQA group resolved inside the kernel. Two
forms, both recorded in a CUDA graph and, with ``compile``, with the decoder layers through
``torch.compile`` exactly as :class:`~oscar_calib.runtime.DecodeGraph` compiles them
(:func:`~oscar_calib.runtime.graph.compiled_layers`):

* ``sdpa``: ``scaled_dot_product_attention(enable_gqa=True)`` over exactly the valid prefix of a
  ``[B, H, cap, d]`` cache (flash attention's split-KV decode). The prefix length is a host
  number, so a graph holds one length: timed by replaying one recorded step.
* ``flash``: flash attention's variable-length form over a token-major ``[B * cap, H, d]`` cache
  with the lengths on the device (``seqused_k``), so one graph serves a growing history: timed as
  a greedy loop, like ``DecodeGraph``'s.
* ``flashinfer_cuda_cores`` / ``flashinfer_tensor_cores``: what a serving engine runs, FlashInfer's
  ``BatchDecodeWithPagedKVCacheWrapper`` over a paged ``[pages, 2, 16, H, d]`` pool per layer
  (one shuffled page table for every layer), planned on the host for the prefix before a step is
  recorded, timed like ``sdpa``; the two forms of :mod:`kernels_flashinfer`, the faster counts.
  Where FlashInfer cannot run, :func:`flashinfer_baseline` says why in one line and the result
  records it.

transformers' stock ``StaticCache`` + SDPA reads the whole preallocated cache through a mask at
every step: ``bench_generate`` keeps it as "transformers' stock path", never as the baseline.

**The roofline** of a step is the bytes it must read (the weights, the embedding table only at
the batch's rows, and the KV cache as stored) over the device-to-device copy bandwidth measured
in the same run (bytes read + written per second, as ``torch`` copies them).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin

from oscar_calib.model.capture import AttentionRoute

ATTENTION_NAME = "bf16_prefix"
FI_PREFIX = "flashinfer_"
MODES = ("sdpa", "flash", "flashinfer_cuda_cores", "flashinfer_tensor_cores")
_ACTIVE: list = []


class PrefixLayer(CacheLayerMixin):
    """One layer of :class:`PrefixCache`: preallocated BF16 K/V, the lengths on the device
    (``lengths``, int32 ``[B]``) and on the host (``seen``, the same for every row)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, mode: str, batch: int, heads: int, d: int, cap: int, device, dtype, paged=None):
        super().__init__()
        self.mode, self.batch, self.heads, self.d, self.cap, self.paged = mode, batch, heads, d, cap, paged
        if paged is not None:    # FlashInfer: one pool of pages (keys at [:, 0], values at [:, 1])
            self.kv = torch.zeros(paged.pages, 2, paged.page, heads, d, device=device, dtype=dtype)
            self.first = paged.indptr[:-1].long()                           # each row's first page entry
        else:
            shape = (batch, heads, cap, d) if mode == "sdpa" else (batch * cap, heads, d)
            self.k = torch.zeros(shape, device=device, dtype=dtype)
            self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=device)
        self.rows = torch.arange(batch, device=device) * cap                 # first slot of each row
        self.cu_q = torch.arange(batch + 1, dtype=torch.int32, device=device)
        self.cu_k = self.cu_q * cap
        self.seen = 0
        self.is_initialized = True

    def fill(self, tokens: int) -> None:
        """``tokens`` random tokens per row (what a prefill would leave; FlashInfer's whole pool)."""
        if self.paged is not None:
            self.kv.normal_()
        else:
            for t in (self.k, self.v):
                view = t if self.mode == "sdpa" else t.view(self.batch, self.cap, self.heads, self.d)
                (view[:, :, :tokens] if self.mode == "sdpa" else view[:, :tokens]).normal_()
        self.lengths.fill_(tokens)
        self.seen = tokens

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store one new token per row at each row's length (device indices: graph-safe)."""
        if key_states.shape[2] != 1:
            raise ValueError("the BF16 baseline cache takes decode steps only (fill() stands for the prefill)")
        if self.paged is not None:
            pos = self.lengths.long()
            pages = self.paged.indices[self.first + pos // self.paged.page].long()
            self.kv[pages, 0, pos % self.paged.page] = key_states[:, :, 0]
            self.kv[pages, 1, pos % self.paged.page] = value_states[:, :, 0]
        elif self.mode == "sdpa":
            idx = self.lengths.long().view(-1, 1, 1, 1).expand(-1, self.heads, 1, self.d)
            self.k.scatter_(2, idx, key_states)
            self.v.scatter_(2, idx, value_states)
        else:
            slots = self.rows + self.lengths.long()
            self.k.index_copy_(0, slots, key_states[:, :, 0])
            self.v.index_copy_(0, slots, value_states[:, :, 0])
        self.lengths += 1
        self.seen += 1
        return key_states, value_states

    def attend(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of one query row per head ``[B, Hq, 1, d]`` over the held tokens: ``[B, 1, Hq, d]``."""
        if self.paged is not None:
            if torch.cuda.is_current_stream_capturing() and self.paged.planned != ([self.seen] * self.batch, scale):
                raise RuntimeError(f"FlashInfer is planned for {self.paged.planned}, not {self.seen} tokens: "
                                   "prepare() the cache before recording")
            self.paged.plan([self.seen] * self.batch, scale)
            return self.paged(query[:, :, 0].contiguous(), self.kv, None).unsqueeze(1)
        if self.mode == "sdpa":
            n = self.seen
            out = F.scaled_dot_product_attention(query, self.k[:, :, :n], self.v[:, :, :n], scale=scale,
                                                 enable_gqa=True)
            return out.transpose(1, 2)
        q = query[:, :, 0].contiguous()                                       # [B, Hq, d]: one token per row
        out = torch.ops.aten._flash_attention_forward(q, self.k, self.v, self.cu_q, self.cu_k, 1, self.cap, 0.0,
                                                      False, False, scale=scale, seqused_k=self.lengths)[0]
        return out.unsqueeze(1)

    def dense(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``tokens`` keys and values of each row, ``[B, H, tokens, d]`` each."""
        if self.paged is not None:
            per = -(-tokens // self.paged.page)
            rows = [self.kv[self.paged.indices[int(f):int(f) + per].long()] for f in self.first]
            return tuple(torch.stack([r[:, i].flatten(0, 1)[:tokens] for r in rows]).transpose(1, 2)
                         for i in (0, 1))
        if self.mode == "sdpa":
            return self.k[:, :, :tokens], self.v[:, :, :tokens]
        return tuple(t.view(self.batch, self.cap, self.heads, self.d)[:, :tokens].transpose(1, 2)
                     for t in (self.k, self.v))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, self.seen            # the mask covers this call's token; the lengths the rest

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return self.cap

    def reset(self) -> None:
        self.lengths.zero_()
        self.seen = 0


class PrefixCache(Cache):
    """The fair BF16 baseline's cache (see the module docstring); ``mode`` in :data:`MODES`."""

    def __init__(self, config, mode: str, batch: int, cap: int, device, dtype=torch.bfloat16):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        h, d = config.num_key_value_heads, config.head_dim
        paged = None
        if mode.startswith(FI_PREFIX):
            from kernels_flashinfer import FORMS, Decode, flashinfer_status

            if torch.device(device).type != "cuda":
                raise RuntimeError("FlashInfer needs a CUDA device (this run is on the CPU)")
            status = flashinfer_status(cuda=True)
            if not status["available"]:
                raise RuntimeError(status["skipped"])
            shape = {"q_heads": config.num_attention_heads, "kv_heads": h, "head_dim": d}
            paged = Decode(status["module"], [cap] * batch, shape, device,
                           tensor_cores=FORMS[mode[len(FI_PREFIX):]])
        super().__init__(layers=[PrefixLayer(mode, batch, h, d, cap, device, dtype, paged)
                                 for _ in range(config.num_hidden_layers)])
        self.paged = paged

    def prepare(self, tokens: int) -> None:
        """Plan FlashInfer for a step that reads ``tokens`` tokens per row (host work, outside a
        graph's recording; the scale is the one the last step planned). Nothing to do for the rest."""
        if self.paged is not None:
            self.paged.plan([tokens] * self.layers[0].batch, self.paged.planned[1])

    def fill(self, tokens: int) -> "PrefixCache":
        for layer in self.layers:
            layer.fill(tokens)
        return self

    def nbytes(self, tokens: int) -> int:
        """Bytes of K/V a step reads at ``tokens`` tokens per row."""
        layer = self.layers[0]
        return len(self.layers) * 2 * layer.batch * layer.heads * tokens * layer.d * layer.k.element_size()

    def attach(self, model):
        return _Route(model, self)


def _attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    cache = _ACTIVE[-1].cache
    return cache.layers[module.layer_idx].attend(query, scaling or query.shape[-1] ** -0.5), None


class _Route(AttentionRoute):
    name = ATTENTION_NAME
    active = _ACTIVE

    def __init__(self, model, cache):
        self.model, self.cache = model, cache

    def __enter__(self):
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_NAME, _attention)
        return self._route("sdpa")


def _compiled(model, cache, on: bool):
    from oscar_calib.runtime.graph import compiled_layers, decoder_layers

    if not on:
        return contextlib.nullcontext()
    layers = decoder_layers(model)
    dyn = torch._dynamo.config
    dyn.recompile_limit = max(dyn.recompile_limit, 2 * len(layers) + 8)
    return compiled_layers(layers, cache, ATTENTION_NAME, _attention)


def _step(model, cache, ids, pos):
    return model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1).logits


def replay_ms(model, mode: str, batch: int, tokens: int, *, compile: bool = False, replays: int = 20) -> float:
    """GPU time of one decode step at ``tokens`` tokens per row, recorded in a CUDA graph and
    replayed (the timing of ``bench_generate_runs.graph_ms``; each replay stores a token, reads
    the prefix the recording read)."""
    dev = model.device
    cache = PrefixCache(model.config, mode, batch, tokens + replays + 8, dev).fill(tokens)
    ids = torch.zeros(batch, 1, dtype=torch.long, device=dev)
    pos = torch.full((batch, 1), tokens, dtype=torch.long, device=dev)
    with cache.attach(model), _compiled(model, cache, compile), torch.no_grad():
        for _ in range(2):                                   # compiles, warms up (stores 2 tokens)
            _step(model, cache, ids, pos)
        for layer in cache.layers:
            layer.seen = tokens                              # the recording reads the prefix of `tokens`
        cache.prepare(tokens + 1)                            # (and the token it stores)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            _step(model, cache, ids, pos)
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / replays


def loop(model, batch: int, tokens: int, new: int, *, compile: bool = False) -> dict:
    """Wall time per token of a greedy loop whose steps replay one CUDA graph (``flash`` mode: the
    history grows on the device), timed as ``bench_generate_runs.graph_decode`` times
    ``DecodeGraph``: argmax and the copies into the graph's inputs included."""
    dev = model.device
    cache = PrefixCache(model.config, "flash", batch, tokens + new + 8, dev).fill(tokens)
    ids = torch.zeros(batch, 1, dtype=torch.long, device=dev)
    pos = torch.full((batch, 1), tokens, dtype=torch.long, device=dev)
    with cache.attach(model), _compiled(model, cache, compile), torch.no_grad():
        t0 = time.perf_counter()
        tok = _step(model, cache, ids, pos).argmax(-1)      # eager: compiles, warms up
        pos += 1
        ids.copy_(tok)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            logits = _step(model, cache, ids, pos)
        setup = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(new):
            g.replay()
            tok = logits.argmax(-1)
            ids.copy_(tok)
            pos += 1
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"wall_ms_per_step": 1e3 * wall / new, "tok_s": batch * new / wall, "setup_s": setup}


def copy_bandwidth(gib: float = 2.0, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + written), median of ``repeats``."""
    n = int(gib * 2**30) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n * 2 / sorted(times)[len(times) // 2]


def weight_bytes(model, batch: int) -> int:
    """Bytes of weights a decode step reads: every parameter once, the input embedding table only
    at the batch's rows (a tied output projection reads it whole)."""
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == emb.data_ptr()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not tied:
        total -= emb.numel() * emb.element_size() - batch * emb.shape[1] * emb.element_size()
    return total


def roofline_ms(nbytes: int, bandwidth: float) -> float:
    return 1e3 * nbytes / bandwidth


CATEGORIES = (("GEMV/GEMM (weights)", ("gemv", "gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk")),
              ("INT2 write + query rotation", ("append_token", "quantize_kv", "rotate_query")),
              ("INT2 decode + merge", ("decode_kernel", "decode_merge")),
              ("flash attention (BF16)", ("flash",)))


def categorise(name: str) -> str:
    low = name.lower()
    for label, keys in CATEGORIES:
        if any(k in low for k in keys):
            return label
    return "norms, RoPE, small ops"


def profile_step(run, steps: int = 5) -> dict:
    """Kernel time per category (ms per step) of ``steps`` eager calls of ``run`` (torch profiler),
    the kernels' sum and how many kernels (and copies) a step launches; a graph replay of the same
    step minus that sum, over that count, is the mean gap between two kernels."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    cats: dict[str, float] = {}
    launches = 0
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        if t:
            c = categorise(e.key)
            cats[c] = cats.get(c, 0.0) + t / 1e3 / steps
            launches += e.count
    return {"by_category_ms": cats, "kernels_ms": sum(cats.values()), "launches": launches / steps}


def agrees_with_dynamic(model, mode: str, batch: int, tokens: int, steps: int = 3) -> float:
    """Largest relative difference of the logits of ``steps`` greedy decode steps between
    :class:`PrefixCache` and transformers' ``DynamicCache`` holding the same K/V (the baseline
    computes the model's own attention)."""
    from transformers import DynamicCache

    dev = model.device
    ours = PrefixCache(model.config, mode, batch, tokens + steps + 1, dev, model.dtype).fill(tokens)
    ref = DynamicCache(config=model.config)
    for i, layer in enumerate(ours.layers):
        k, v = layer.dense(tokens)
        ref.update(k.clone(), v.clone(), i)
    ids = torch.zeros(batch, 1, dtype=torch.long, device=dev)
    worst = 0.0
    with torch.no_grad():
        for s in range(steps):
            pos = torch.full((batch, 1), tokens + s, dtype=torch.long, device=dev)
            want = model(input_ids=ids, position_ids=pos, past_key_values=ref, use_cache=True).logits.float()
            with ours.attach(model):
                got = _step(model, ours, ids, pos).float()
            worst = max(worst, ((got - want).norm() / want.norm()).item())
            ids = want.argmax(-1)
    return worst


def int2_kv_bytes(model, batch: int, tokens: int, group_size: int, sink: int = 64, recent: int = 256) -> int:
    """Bytes of the OSCAR cache a decode step reads at ``tokens`` tokens per row: the BF16 sink and
    recent window, and the INT2 history between them (2 bits per element plus an fp16 scale and
    offset per group of ``group_size``)."""
    c = model.config
    d, h, n = c.head_dim, c.num_key_value_heads, c.num_hidden_layers
    window = min(tokens, sink + recent)
    per_row = window * d * 2 + (tokens - window) * (d // 4 + 4 * d // group_size)
    return n * 2 * h * batch * per_row


def flashinfer_baseline(model, batch: int = 2, tokens: int = 300) -> dict:
    """FlashInfer's forms that run here and compute the model's attention: the greedy logits'
    relative distance to transformers' ``DynamicCache`` over the same K/V within ``tolerance``, the
    larger of 2% and 1.5 times the ``flash`` form's own distance (another BF16 flash kernel in the
    same model: 36 random layers carry a BF16 kernel's rounding to about 5% of the logits, where
    the ``sdpa`` form, the reference's own kernel, is at 0). Returns ``{"version", "forms": [...],
    "checks": {form: distance or error}, "tolerance"}``, with ``skipped`` (one line) where no form
    runs and agrees."""
    from kernels_flashinfer import FORMS, flashinfer_status, one_line

    if model.device.type != "cuda":
        return {"skipped": "FlashInfer needs a CUDA device (this run is on the CPU)"}
    status = flashinfer_status(cuda=True)
    if not status["available"]:
        return {"skipped": status["skipped"]}
    flash = agrees_with_dynamic(model, "flash", batch, tokens)
    res = {"version": status["version"], "forms": [], "checks": {"flash": flash},
           "tolerance": max(2e-2, 1.5 * flash)}
    for form in FORMS:
        try:
            diff = agrees_with_dynamic(model, FI_PREFIX + form, batch, tokens)
        except Exception as e:  # noqa: BLE001 - this form is left out, with its reason
            res["checks"][form] = one_line(e)
            continue
        res["checks"][form] = diff
        if diff < res["tolerance"]:
            res["forms"].append(form)
    if not res["forms"]:
        res["skipped"] = f"FlashInfer {status['version']}: no form agrees or runs ({res['checks']})"
    torch.cuda.empty_cache()
    return res


def fair_record(model, batch: int, tokens: int, args, bandwidth: float, flashinfer_forms=()) -> dict:
    """One row of the fair table: the BF16 baseline in each form (FlashInfer's ``flashinfer_forms``,
    those :func:`flashinfer_baseline` passed) and the OSCAR cache through ``DecodeGraph``, plain and
    compiled, with each step's bytes and roofline."""
    from bench_generate_runs import graph_decode

    wbytes = weight_bytes(model, batch)
    bf16_kv = 2 * model.config.num_hidden_layers * batch * model.config.num_key_value_heads * tokens \
        * model.config.head_dim * 2
    int2_kv = int2_kv_bytes(model, batch, tokens, args.group_size)
    rec = {"batch": batch, "tokens": tokens, "weight_bytes": wbytes, "bf16_kv_bytes": bf16_kv,
           "int2_kv_bytes": int2_kv, "bf16_roofline_ms": roofline_ms(wbytes + bf16_kv, bandwidth),
           "int2_roofline_ms": roofline_ms(wbytes + int2_kv, bandwidth)}
    for compiled in (False, True):
        tag = "compiled_" if compiled else ""
        rec[f"{tag}bf16_sdpa_replay_ms"] = replay_ms(model, "sdpa", batch, tokens, compile=compiled)
        for form in flashinfer_forms:
            rec[f"{tag}bf16_{FI_PREFIX}{form}_replay_ms"] = replay_ms(model, FI_PREFIX + form, batch, tokens,
                                                                    compile=compiled)
            torch.cuda.empty_cache()
        if flashinfer_forms:
            best = min(flashinfer_forms, key=lambda f: rec[f"{tag}bf16_{FI_PREFIX}{f}_replay_ms"])
            rec[f"{tag}bf16_flashinfer_replay_ms"] = rec[f"{tag}bf16_{FI_PREFIX}{best}_replay_ms"]
            rec[f"{tag}flashinfer_form"] = best
        flash = loop(model, batch, tokens, args.new, compile=compiled)
        rec[f"{tag}bf16_flash_loop_ms"] = flash["wall_ms_per_step"]
        int2 = graph_decode(model, batch, tokens, args.new, args, compile=compiled)
        rec[f"{tag}int2_loop_ms"] = int2["graph_wall_ms_per_step"]
        rec[f"{tag}setup_s"] = {"bf16_flash": flash["setup_s"], "int2": int2["graph_setup_s"]}
        bf16 = min(rec[f"{tag}bf16_sdpa_replay_ms"], rec[f"{tag}bf16_flash_loop_ms"],
                   rec.get(f"{tag}bf16_flashinfer_replay_ms", float("inf")))
        rec[f"{tag}bf16_ms"] = bf16
        rec[f"{tag}speedup"] = bf16 / rec[f"{tag}int2_loop_ms"]
        rec[f"{tag}bf16_roofline_pct"] = 100 * rec["bf16_roofline_ms"] / bf16
        rec[f"{tag}int2_roofline_pct"] = 100 * rec["int2_roofline_ms"] / rec[f"{tag}int2_loop_ms"]
        torch.cuda.empty_cache()
    return rec


def capacity(model, tokens: int, args) -> dict:
    """How many sequences of ``tokens`` each cache holds on this GPU beside the weights (4 GiB kept
    for activations, the graph and the kernels' scratch), and the decode tokens/s at those batch
    sizes (compiled graphs, as the fair table's best rows); also the OSCAR cache at 8 x 64K, a
    batch the BF16 cache cannot hold."""
    from bench_generate_runs import graph_decode

    free = torch.cuda.mem_get_info()[0] - 4 * 2**30
    c = model.config
    bf16_row = 2 * c.num_hidden_layers * c.num_key_value_heads * (tokens + args.new + 8) * c.head_dim * 2
    int2_row = int2_kv_bytes(model, 1, tokens + args.new + 8, args.group_size)
    rec = {"tokens": tokens, "free_gib": free / 2**30, "bf16_batch": int(free // bf16_row),
           "int2_batch": int(free // int2_row)}
    if rec["bf16_batch"]:
        rec["bf16_tok_s"] = loop(model, rec["bf16_batch"], tokens, args.new, compile=True)["tok_s"]
        torch.cuda.empty_cache()
    for b in (rec["int2_batch"], int(rec["int2_batch"] * 0.9)):     # (if the estimate was too tight)
        try:
            rec["int2_tok_s"] = graph_decode(model, b, tokens, args.new, args, compile=True)["graph_tok_s"]
            rec["int2_batch"] = b
            break
        except torch.cuda.OutOfMemoryError:
            rec.setdefault("int2_oom_at", []).append(b)
        finally:
            torch.cuda.empty_cache()
    rec["int2_8x64k_tok_s"] = graph_decode(model, 8, 65536, args.new, args, compile=True)["graph_tok_s"]
    return rec


def profile_record(model, batch: int, tokens: int, args) -> dict:
    """Where a compiled decode step's time goes (kernel time by category, eager steps under the
    profiler) for the OSCAR cache and the BF16 baseline (``sdpa``), beside the loop's wall time."""
    from bench_generate_runs import make_cache

    from oscar_calib.runtime.attention import ATTENTION_NAME, registered_attention
    from oscar_calib.runtime.graph import compiled_layers, decoder_layers

    dev = model.device
    ids = torch.zeros(batch, 1, dtype=torch.long, device=dev)
    pos = torch.full((batch, 1), tokens, dtype=torch.long, device=dev)
    out = {"batch": batch, "tokens": tokens}
    cache = make_cache("oscar", model, batch, tokens, 64, args)
    with cache.attach(model), compiled_layers(decoder_layers(model), cache, ATTENTION_NAME, registered_attention), \
            torch.no_grad():
        out["int2"] = profile_step(lambda: _step(model, cache, ids, pos))
    cache = None                                     # (frees the INT2 cache before the BF16 one is built)
    torch.cuda.empty_cache()
    base = PrefixCache(model.config, "sdpa", batch, tokens + 64, dev).fill(tokens)
    with base.attach(model), _compiled(model, base, True), torch.no_grad():
        out["bf16"] = profile_step(lambda: _step(model, base, ids, pos))
    return out
