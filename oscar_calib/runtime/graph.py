"""Decode steps of the real cache replayed from a CUDA graph: :class:`DecodeGraph`, and
:func:`graph_decoding`, which runs ``model.generate()`` on it.

An eager decode step launches ~60 kernels per layer from Python (as many as a ``DynamicCache``
step), so on a small or mid-sized model it is bound by the host, not the GPU. The step is graph-safe (device ops only,
slots from the device counts; a masked step decides on the device which rows store their token),
so it can be recorded once and replayed per token.

>>> cache.reserve(prompt_len + new_tokens)          # a replay cannot grow the history
>>> with cache.attach(model), torch.no_grad():
...     logits = model(ids, past_key_values=cache).logits[:, -1:]      # prefill, eager
...     step = DecodeGraph(model, cache)
...     for i in range(new_tokens):
...         tok = logits.argmax(-1)                                     # [B, 1]
...         logits = step(tok, pos + i)                                 # [B, 1, vocab]

The first call runs eagerly (it compiles the kernels), the second records the step and replays
it, every later call replays it; each call stores one token per sequence, as an eager step does.
The returned logits live in the graph's output buffer: the next call overwrites them.

``generate()`` itself, through the decoding-method hook of transformers (``custom_generate``
takes a callable in 5.17 and later):

>>> out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=256,
...                      custom_generate=graph_decoding)

runs greedy search or sampling with transformers' own logits processors and stopping criteria,
the prompt eagerly and every new token from the graph (eager steps where there is no graph: on the
CPU, and for a model spread over several devices or offloaded).
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import CacheError, InputError, UnsupportedModelError


def graph_device(model) -> torch.device | None:
    """The one CUDA device holding all of ``model``'s parameters, or None (a CPU model, or one spread
    over several devices or offloaded: a CUDA graph records one device's work)."""
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        return None
    (device,) = devices
    return device if device.type == "cuda" else None


class DecodeGraph:
    """One decode step of ``model`` (any transformers causal LM) over an attached, prefilled
    :class:`~oscar_calib.runtime.cache.OscarCache`, captured in a CUDA graph (see the module
    docstring). ``room``: tokens per sequence the reserved history still takes.

    ``compile=True``: the first two calls (the eager warm-up and the recording) run each decoder
    layer through ``torch.compile``, with the cache update and the attention left out of it, so the
    model's small ops between them fuse; the replays keep the compiled kernels, and the model is
    left as it was. The logits then follow the eager step up to the rounding of the fused kernels,
    not bit for bit. H200, Qwen3-8B shapes, 36 layers, 1 x 16K: 8.00 -> 5.96-6.25 ms per replayed
    step, for ~8 s of compiling in the first two calls. It raises torch._dynamo's recompile limit
    for the process (each batch size compiles again)."""

    def __init__(self, model, cache, *, compile: bool = False):
        from .cache import OscarCache

        if not isinstance(cache, OscarCache):
            raise InputError(f"DecodeGraph needs an OscarCache, got {type(cache).__name__}")
        device = graph_device(model)
        if device is None:
            where = ", ".join(sorted({str(p.device) for p in model.parameters()}))
            raise InputError(f"DecodeGraph needs a CUDA model on one GPU (CUDA graphs); its parameters are on {where}")
        if cache.recurrent:
            raise InputError(f"DecodeGraph records the KV cache's attention only; {cache.recurrent}: decode it "
                             "with eager steps (runtime.generate does)")
        layers = cache.layers
        if not layers or any(layer.store is None for layer in layers):
            raise CacheError("DecodeGraph needs a prefilled cache: run the prompt through the model first")
        if any(not layer.attached for layer in layers):
            raise CacheError("DecodeGraph needs the cache attached: call it inside `with cache.attach(model):`")
        self.model, self.cache, self.device = model, cache, device
        self.batch = layers[0].store.batch
        full = [layer.store for layer in layers if not layer.store.hist.ring]
        self.room = min((st.hist.cap + st.plan.sink - max(st.exact_counts()) for st in full), default=1 << 62)
        self.calls = 0
        self.graph = None
        self.compile = bool(compile)
        self._layers = None
        if self.compile:
            found = self._layers = decoder_layers(model)
            if found is None:
                raise InputError("DecodeGraph(compile=True) needs the model's decoder layers "
                                 "(the layer list of its text model)")
            # each batch size (and each cache a process decodes with) compiles the layers' code
            # again: room for them, where the default of 8 recompiles per function would leave
            # the rest eager. Raised for the process (never lowered); set inside the compiling
            # call it did not take effect.
            dyn = torch._dynamo.config
            dyn.recompile_limit = max(dyn.recompile_limit, 2 * len(found) + 8)
        self._ids = self._pos = self._logits = None
        self._gate = torch.ones(self.batch, dtype=torch.bool, device=device)   # rows that store their token

    def _step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        from .attention import ATTENTION_NAME, registered_attention

        compiled = compiled_layers(self._layers, self.cache, ATTENTION_NAME, registered_attention)
        with compiled if self.compile else contextlib.nullcontext():
            return self.model(input_ids=ids, position_ids=positions, past_key_values=self.cache,
                              use_cache=True).logits

    def _host_state(self) -> list:
        return [(layer.seen, list(layer.store.counts), layer.store.counts_stale) for layer in self.cache.layers]

    def _set_host_state(self, state: list) -> None:
        for layer, (seen, counts, stale) in zip(self.cache.layers, state):
            layer.seen, layer.store.counts, layer.store.counts_stale, layer.pending = seen, counts, stale, None

    def _advance_host(self, steps: int = 1) -> None:
        """What an eager step does on the host, which a replay skips: one more token per row."""
        for layer in self.cache.layers:
            layer.seen += steps
            layer.store.counts = [c + steps for c in layer.store.counts]
            layer.store.counts_stale = True       # (a masked row may not have stored its token)

    def retract(self) -> None:
        """Take back the host bookkeeping of the last call, for a call whose rows stored nothing
        (``store`` all False: a step run ahead of a stop decision)."""
        self._advance_host(-1)
        self.calls -= 1

    def _gated(self, store: torch.Tensor | None, run):
        """``run()`` with the step's settings on every layer: the row gate, and the torch decode
        path (sliding-window, soft-capped layers) reading the whole history, since a replay cannot
        widen what the recording read."""
        self._gate.copy_(store) if store is not None else self._gate.fill_(True)
        for layer in self.cache.layers:
            layer.gate, layer.store.full_span = self._gate, True
        try:
            return run()
        finally:
            for layer in self.cache.layers:
                layer.gate, layer.store.full_span = None, False

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, store: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, 1, vocab]`` of the next tokens ``ids`` at ``positions`` (both ``[B, 1]``);
        ``store`` (device bool ``[B]``, None: all): the rows whose token is stored (the others keep
        their count, e.g. rows that finished generating)."""
        want = (self.batch, 1)
        for name, t in (("ids", ids), ("positions", positions)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise InputError(f"DecodeGraph: {name} must be a tensor of shape {want}, got {got}")
        if self.calls >= self.room:
            raise CacheError(f"DecodeGraph: the reserved history is full after {self.calls} steps; "
                             "call cache.reserve(total tokens) before building the graph")
        if store is not None and (not isinstance(store, torch.Tensor) or store.dtype != torch.bool
                                  or tuple(store.shape) != (self.batch,)):
            raise InputError(f"DecodeGraph: store must be a bool tensor of shape ({self.batch},)")
        self.calls += 1
        if self.calls == 1:                                   # eager: compiles and warms up
            return self._gated(store, lambda: self._step(ids.to(self.device), positions.to(self.device)))
        if self.graph is None:
            self._ids = ids.to(self.device, torch.long).clone()
            self._pos = positions.to(self.device, torch.long).clone()
            torch.cuda.synchronize(self.device)
            before = self._host_state()
            self.graph = torch.cuda.CUDAGraph()

            def record():
                with torch.cuda.graph(self.graph):           # recorded, not run
                    return self._step(self._ids, self._pos)

            self._logits = self._gated(store, record)
            self._set_host_state(before)
        else:
            self._ids.copy_(ids)
            self._pos.copy_(positions)
            self._gate.copy_(store) if store is not None else self._gate.fill_(True)
        self.graph.replay()
        self._advance_host()
        return self._logits


def decoder_layers(model):
    """``model``'s decoder layers (:func:`~oscar_calib.model.geometry.decoder_module`'s ``layers``), or
    None where it has none."""
    from ..model.geometry import decoder_module

    try:
        layers = getattr(decoder_module(model), "layers", None)
    except UnsupportedModelError:
        return None
    return layers if isinstance(layers, torch.nn.ModuleList) and len(layers) else None


@contextlib.contextmanager
def compiled_layers(layers, cache, attention_name: str, attention):
    """Each of the decoder ``layers`` runs its forward through ``torch.compile`` (one compiled code
    shared by the layers), with ``cache.update`` and the attention function registered as
    ``attention_name`` left out of it (graph breaks), so the model's own small ops between them
    (norms, RoPE, residual adds, the MLP's activation) fuse. The model is as before on exit; a step
    recorded in a CUDA graph keeps the compiled kernels. :class:`DecodeGraph` uses it for the real
    cache; the decode benchmark uses it for its BF16 baseline, so both compile alike."""
    from transformers import AttentionInterface

    AttentionInterface.register(attention_name, torch.compiler.disable(attention))
    cache.update = torch.compiler.disable(type(cache).update.__get__(cache))
    for layer in layers:
        layer.forward = _compiled_forward(type(layer)).__get__(layer)
    try:
        # a layer's integer attributes (its index) as inputs, not constants: one compiled code for
        # every layer instead of one per layer
        with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
            yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
        cache.__dict__.pop("update", None)
        AttentionInterface.register(attention_name, attention)


_COMPILED: dict = {}


def _compiled_forward(cls):
    fn = _COMPILED.get(cls)
    if fn is None:
        fn = _COMPILED[cls] = torch.compile(cls.forward)
    return fn


def _refusal(generation_config, model_kwargs, synced_gpus) -> str | None:
    if synced_gpus:
        return "synced_gpus is not supported"
    if getattr(generation_config, "num_beams", 1) not in (None, 1):
        return "it runs greedy search and sampling only (num_beams=1)"
    for flag in ("output_attentions", "output_hidden_states"):
        if getattr(generation_config, flag, False):
            return f"{flag} is not supported (the graph keeps logits only)"
    if model_kwargs.get("inputs_embeds") is not None:
        return "it takes input_ids, not inputs_embeds"
    return None


def graph_refusal(model, **generate_kwargs) -> str | None:
    """Why ``generate(**generate_kwargs)`` on ``model`` cannot decode from a CUDA graph (None: it
    can): the model is not on one GPU (a CPU model, one spread over several devices or offloaded),
    or the call asks for what :func:`graph_decoding` does not run (beam search, attentions or
    hidden states in the output, ``inputs_embeds``, ``synced_gpus``)."""
    import copy

    if graph_device(model) is None:
        where = sorted({str(p.device) for p in model.parameters()})
        if "meta" in where:
            return "the model is offloaded (a CUDA graph records one GPU's work)"
        if len(where) > 1:
            return f"the model is spread over {', '.join(where)} (a CUDA graph records one GPU's work)"
        return f"the model is on {where[0]}, not a GPU"
    config = copy.deepcopy(generate_kwargs.get("generation_config") or model.generation_config)
    rest = config.update(**{k: v for k, v in generate_kwargs.items() if k != "generation_config"})
    return _refusal(config, rest, bool(generate_kwargs.get("synced_gpus")))


def prompt_positions(mask: torch.Tensor | None, batch: int, length: int, device) -> torch.Tensor:
    """Position ids of a (left-padded) prompt: each row counts its real tokens from 0 (pads get 0;
    the cache does not store them)."""
    if mask is None:
        return torch.arange(length, device=device).expand(batch, length)
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def graph_decoding(model, input_ids: torch.Tensor, logits_processor, stopping_criteria, generation_config,
                   synced_gpus: bool = False, streamer=None, compile: bool = False, **model_kwargs):
    """A decoding method for ``model.generate(..., custom_generate=graph_decoding)`` with
    ``past_key_values=OscarCache(...)`` (see the module docstring): the prompt runs eagerly, every
    new token from a :class:`DecodeGraph` on one GPU (eager steps otherwise). Greedy search or
    sampling (``do_sample``), with the logits processors and stopping criteria ``generate()``
    built from its arguments; finished rows are padded as ``generate()`` pads them. A cache that
    an earlier call filled goes on from there (the input starts with its tokens, as in
    ``generate()``). Returns the
    token ids ``[B, prompt + new]``, or with ``return_dict_in_generate`` a
    ``GenerateDecoderOnlyOutput`` (``sequences``, and ``scores`` / ``logits`` when asked). The cache
    is attached for the call if it is not yet, and reserved for ``max_length`` tokens.
    ``custom_generate=functools.partial(graph_decoding, compile=True)``: the graph records the
    model's layers through ``torch.compile`` (:class:`DecodeGraph` ``compile``)."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    from .cache import OscarCache

    cache = model_kwargs.get("past_key_values")
    if not isinstance(cache, OscarCache):
        raise InputError("graph_decoding needs past_key_values=OscarCache(...) in the generate() call; got "
                         f"{type(cache).__name__}")
    why = _refusal(generation_config, model_kwargs, synced_gpus)
    if why:
        raise InputError(f"graph_decoding: {why}")
    batch, length = input_ids.shape
    cached = cache.get_seq_length()                  # tokens an earlier call left (a conversation's turns)
    if cached >= length:
        raise InputError(f"graph_decoding: the cache holds {cached} tokens and the input {length}; the input "
                         "must start with the cached tokens and add at least one")
    device = input_ids.device
    mask = model_kwargs.get("attention_mask")
    positions = prompt_positions(mask, batch, length, device)
    real = mask.long().sum(-1) if mask is not None else torch.full((batch,), length, device=device)
    cache.reserve(int(generation_config.max_length) + 1)
    keep = {"logits_to_keep": 1} if model_kwargs.get("logits_to_keep") is not None else {}
    want_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    want_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    scores_out, logits_out = [], []
    pad = generation_config._pad_token_tensor
    pads_finished = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    if pads_finished and pad is None:
        raise InputError("graph_decoding: an EOS stop needs a pad_token_id to fill finished rows")
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    # with only length limits the host knows when to stop: no wait for the GPU per token
    from transformers.generation.stopping_criteria import MaxLengthCriteria

    limits = [c.max_length for c in stopping_criteria if isinstance(c, MaxLengthCriteria)]
    host_stop = limits and len(limits) == len(stopping_criteria)          # no other stop
    ids = input_ids
    on_cuda = graph_device(model) is not None and not cache.recurrent   # (else eager steps: CPU, spread, hybrid)
    ctx = cache.attach(model) if not cache.oscar_layers[0].attached else contextlib.nullcontext()
    with ctx, torch.no_grad():
        out = model(input_ids=input_ids[:, cached:], attention_mask=mask, position_ids=positions[:, cached:],
                    past_key_values=cache, use_cache=True, **keep)
        logits = out.logits[:, -1]
        step = DecodeGraph(model, cache, compile=compile) if on_cuda else None
        ahead = step is not None and streamer is None and not host_stop          # (a streamer reads every token)
        if ahead:
            flag = torch.zeros((), dtype=torch.bool, pin_memory=True)
            done = torch.cuda.Event()
        i = 0
        while True:
            raw = logits.to(device=device, dtype=torch.float32, copy=True)
            scores = logits_processor(ids, raw)
            if generation_config.do_sample:
                nxt = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            else:
                nxt = scores.argmax(-1)
            if pads_finished:
                nxt = torch.where(unfinished, nxt, pad.to(device))
            ids = torch.cat([ids, nxt[:, None]], dim=-1)
            if want_scores:
                scores_out.append(scores)
            if want_logits:
                logits_out.append(raw)
            if streamer is not None:
                streamer.put(nxt.cpu())
            pos = (real + i)[:, None]
            if limits and ids.shape[1] >= min(limits):      # the length limit, known on the host
                break
            if ahead:
                # the stop decision of this token reaches the host while the next step runs; rows
                # that finished store nothing, so a step run past the end leaves the cache as it was
                unfinished &= ~stopping_criteria(ids, scores)
                flag.copy_(unfinished.any(), non_blocking=True)
                done.record()
                logits = step(nxt[:, None], pos, store=unfinished)[:, -1]
                done.synchronize()
                if not bool(flag):
                    step.retract()
                    break
                i += 1
                continue
            if not host_stop:
                unfinished &= ~stopping_criteria(ids, scores)
                if not bool(unfinished.any()):
                    break
            if step is not None:
                logits = step(nxt[:, None], pos, store=unfinished if pads_finished else None)[:, -1]
            else:
                logits = model(input_ids=nxt[:, None], position_ids=pos, past_key_values=cache, use_cache=True).logits[:, -1]
            i += 1
    if streamer is not None:
        streamer.end()
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=ids, scores=tuple(scores_out) if want_scores else None,
                                         logits=tuple(logits_out) if want_logits else None,
                                         past_key_values=cache)
    return ids


__all__ = ["DecodeGraph", "compiled_layers", "decoder_layers", "graph_decoding", "graph_device", "graph_refusal",
           "prompt_positions"]
