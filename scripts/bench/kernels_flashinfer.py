"""FlashInfer's BF16 decode in ``bench_kernels.py``: a second baseline beside BF16 SDPA.

What a serving engine runs for a decode step of a GQA model whose group is 4 (Qwen3-8B: 32 query
heads, 8 KV heads): ``flashinfer.BatchDecodeWithPagedKVCacheWrapper`` on a paged BF16 cache,
``NHD`` layout, one ``[pages, 2, page, kv_heads, head_dim]`` tensor (keys at ``[:, 0]``, values
at ``[:, 1]``), pages of 16 tokens (vLLM's default block size), each sequence's pages taken in
shuffled order from the pool; the wrapper built with ``use_cuda_graph=True`` and its index buffers,
``plan()`` once per shape outside the timed replays, ``run(q, cache, out=...)`` recorded in the
CUDA graphs that :meth:`kernels_common.Ctx.time` and :meth:`~kernels_common.Ctx.stream` replay,
exactly as the SDPA baseline is timed, in the same run. Two forms (:data:`FORMS`), the faster
counting at each shape as the faster of SDPA's two forms does: ``use_tensor_cores=False``, the
CUDA-core decode kernel, which a serving engine picks at this group size, and
``use_tensor_cores=True`` (FlashInfer's prefill kernel on tensor cores, one query row per
request; ``backend="auto"`` resolves it to ``"fa2"`` for BF16). vLLM's FlashInfer backend (vllm-project/vllm,
``vllm/v1/attention/backends/flashinfer.py``, 2025) asks for tensor cores only when
``num_qo_heads // num_kv_heads > 4``, lays its cache out as ``(num_blocks, 2, block_size,
num_kv_heads, head_size)`` and keeps one graph-mode wrapper per captured batch size; under CUDA
graphs without caller-owned block tables ``"auto"`` stays off cuDNN (``resolved_backend``,
recorded per form). Read from flashinfer-python 0.7.4
(``flashinfer/decode.py``: ``BatchDecodeWithPagedKVCacheWrapper.__init__``, ``plan``, ``run``,
``_auto_prefers_cudnn``; ``flashinfer/prefill.py``: ``get_batch_prefill_module``;
``flashinfer/jit/attention/modules.py``: ``gen_batch_decode_module``, which, like the prefill
modules, JIT-compiles with nvcc at first use unless an AOT copy sits in ``flashinfer/data/aot``).
A GPU machine without network gets the package from ``scripts/dev/flashinfer_bundle.py``.

Where FlashInfer cannot run (not importable, no CUDA device, its decode module fails to build or
to agree with SDPA), :func:`flashinfer_status` says why in one line; the result file records it
(``report["flashinfer"]["skipped"]`` and each row's ``flashinfer_skipped``) and the table and
the report print it, so the column is never silently absent.
"""

from __future__ import annotations

import importlib
import math
import time

import torch
import torch.nn.functional as F

PAGE = 16  # tokens per page: vLLM's default block size
WORKSPACE_BYTES = 128 << 20  # the float workspace FlashInfer's docstring recommends
MAX_ABS_DIFF = 2e-2  # BF16 output against float32 SDPA: a few BF16 ulps of values of order 1
# the wrapper's two forms (``use_tensor_cores``); the faster checked one counts at each shape
FORMS = {"cuda_cores": False, "tensor_cores": True}


def one_line(e: BaseException, width: int = 200) -> str:
    """``Type: first line of the message`` (cut at ``width``): an error as a result records it."""
    msg = str(e)
    return f"{type(e).__name__}: {msg.splitlines()[0][:width] if msg else ''}"


def flashinfer_status(*, cuda: bool, importer=importlib.import_module) -> dict:
    """``{"available": True, "module", "version"}`` or ``{"available": False, "skipped": why}``
    (one line): FlashInfer is timed only where it imports and a CUDA device is present."""
    try:
        fi = importer("flashinfer")
    except Exception as e:  # noqa: BLE001 - any failure to import is the same answer: not here
        return {"available": False, "skipped": f"FlashInfer not importable here ({one_line(e, 160)})"}
    version = getattr(fi, "__version__", "unknown")
    if not cuda:
        return {"available": False, "skipped": f"FlashInfer {version} needs a CUDA device (this run is on the CPU)"}
    return {"available": True, "module": fi, "version": version}


def row_pages(lengths: list[int], page: int, dev) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Pages per sequence of ``lengths`` tokens in pages of ``page``, their ``indptr`` [B+1] and
    ``last_page_len`` [B] (int32 on ``dev``)."""
    per = [max(1, math.ceil(n / page)) for n in lengths]
    indptr = torch.tensor([0] + [sum(per[: i + 1]) for i in range(len(per))], dtype=torch.int32, device=dev)
    last = torch.tensor([n - (p - 1) * page for n, p in zip(lengths, per)], dtype=torch.int32, device=dev)
    return per, indptr, last


def page_table(lengths: list[int], page: int, dev, *, generator=None) -> tuple:
    """``indptr`` [B+1], ``indices`` (every page of the pool once, shuffled) and ``last_page_len``
    [B] of sequences of ``lengths`` tokens in pages of ``page``; and the number of pages."""
    per, indptr, last = row_pages(lengths, page, dev)
    indices = torch.randperm(sum(per), generator=generator).to(torch.int32)
    return indptr, indices.to(dev), last, sum(per)


def paged_from_dense(k: torch.Tensor, v: torch.Tensor, lengths: list[int], indptr, indices, page: int):
    """The ``[pages, 2, page, H, D]`` cache holding ``k``/``v`` ``[B, T, H, D]`` (first
    ``lengths[b]`` tokens of each) at the pages ``indices[indptr[b]:indptr[b+1]]``."""
    b, _, h, d = k.shape
    total = int(indptr[-1])
    cache = torch.zeros(total, 2, page, h, d, dtype=k.dtype, device=k.device)
    for i in range(b):
        pages = indices[int(indptr[i]):int(indptr[i + 1])].long()
        for j, p in enumerate(pages.tolist()):
            n = min(page, lengths[i] - j * page)
            cache[p, 0, :n] = k[i, j * page:j * page + n]
            cache[p, 1, :n] = v[i, j * page:j * page + n]
    return cache


class Decode:
    """A planned ``BatchDecodeWithPagedKVCacheWrapper`` for one batch of sequence lengths, on
    CUDA cores (the decode kernel) or, with ``tensor_cores``, on tensor cores (FlashInfer's
    prefill kernel with one query row per request)."""

    def __init__(self, fi, lengths: list[int], shape: dict, dev, page: int = PAGE, tensor_cores: bool = False):
        indptr, indices, last, self.pages = page_table(lengths, page, dev)
        self.indptr, self.indices, self.page, self.shape = indptr, indices, page, shape
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        self.wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=torch.empty_like(indptr), paged_kv_indices_buffer=torch.empty_like(indices),
            paged_kv_last_page_len_buffer=torch.empty_like(last))
        self.planned = None
        self.plan(lengths)
        self.backend = str(getattr(self.wrapper, "resolved_backend", "unknown"))

    def plan(self, lengths: list[int], sm_scale: float | None = None) -> None:
        """Plan the wrapper for the first ``lengths[b]`` tokens of each sequence's pages (at most the
        lengths the page table was made for); a plan is host work, made before a graph records
        ``run``. ``sm_scale`` is ``plan``'s keyword in flashinfer-python 0.7.4 (``flashinfer/decode.py``;
        None there means ``1/sqrt(head_dim)``)."""
        if self.planned == (list(lengths), sm_scale):
            return
        qh, h, d = self.shape["q_heads"], self.shape["kv_heads"], self.shape["head_dim"]
        first = self.indptr.tolist()
        per, indptr, last = row_pages(lengths, self.page, self.indptr.device)
        if any(p > first[b + 1] - first[b] for b, p in enumerate(per)):
            raise ValueError(f"lengths {lengths} exceed the page table of this Decode")
        indices = torch.cat([self.indices[first[b]:first[b] + p] for b, p in enumerate(per)])
        self.wrapper.plan(indptr, indices, last, qh, h, d, self.page, pos_encoding_mode="NONE",
                          q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=sm_scale)
        self.planned = (list(lengths), sm_scale)

    def random_cache(self, dev) -> torch.Tensor:
        h, d = self.shape["kv_heads"], self.shape["head_dim"]
        return torch.randn(self.pages, 2, self.page, h, d, device=dev, dtype=torch.bfloat16)

    def __call__(self, q, cache, out):
        return self.wrapper.run(q, cache, out=out)


def check_flashinfer(ctx, shape: dict, status: dict) -> dict:
    """Each form of FlashInfer's decode (:data:`FORMS`) against float32 SDPA over the same K/V:
    2 sequences of 3000 and 1507 tokens (the last page of each partly filled), max |diff| of the
    outputs. A form that fails to build, run or agree is left out of the timings, with its reason;
    ``skipped`` when none is left."""
    if not status["available"]:
        return {"skipped": status["skipped"]}
    dev = ctx.dev
    gen = torch.Generator().manual_seed(0)
    qh, h, d = shape["q_heads"], shape["kv_heads"], shape["head_dim"]
    lengths = [3000, 1507]
    k = torch.randn(2, max(lengths), h, d, generator=gen).to(dev, torch.bfloat16)
    v = torch.randn(2, max(lengths), h, d, generator=gen).to(dev, torch.bfloat16)
    q = torch.randn(2, qh, d, generator=gen).to(dev, torch.bfloat16)
    want = [F.scaled_dot_product_attention(q[i].float().view(1, qh, 1, d), k[i, :n].float().transpose(0, 1)[None],
                                           v[i, :n].float().transpose(0, 1)[None], enable_gqa=True).view(qh, d)
            for i, n in enumerate(lengths)]
    res = {"lengths": lengths, "page": PAGE, "version": status["version"], "forms": {}}
    for form, tc in FORMS.items():
        t0 = time.time()
        try:
            dec = Decode(status["module"], lengths, shape, dev, tensor_cores=tc)  # builds or loads the module
            cache = paged_from_dense(k, v, lengths, dec.indptr, dec.indices, dec.page)
            got = dec(q, cache, torch.empty_like(q)).float()
        except Exception as e:  # noqa: BLE001 - this form is left out, the rest of the run goes on
            res["forms"][form] = {"ok": False, "error": one_line(e)}
            continue
        diff = max(float((got[i] - want[i]).abs().max()) for i in range(len(lengths)))
        res["forms"][form] = {"ok": diff < MAX_ABS_DIFF, "max_abs_diff": diff, "backend": dec.backend,
                              "first_call_s": time.time() - t0}
        if diff >= MAX_ABS_DIFF:
            res["forms"][form]["error"] = f"disagrees with SDPA: max |diff| {diff:.3g} >= {MAX_ABS_DIFF}"
    ok = [f for f, r in res["forms"].items() if r["ok"]]
    res["ok_forms"] = ok
    if ok:
        res["max_abs_diff"] = max(res["forms"][f]["max_abs_diff"] for f in ok)
    else:
        res["skipped"] = f"FlashInfer {status['version']}: " + "; ".join(
            f"{f} {r['error']}" for f, r in res["forms"].items())
    return res


def time_flashinfer(ctx, c: int, batch: int, shape: dict, q: torch.Tensor, bf_bytes: int, copies: int,
                    sdpa_ms: float | None) -> dict:
    """Row fields of FlashInfer's decode at ``batch`` sequences of ``c`` tokens, each checked form
    timed as SDPA is (``copies`` pools rotated, one graph per call; in stream); the faster form
    counts (``flashinfer_form``), as the faster of SDPA's two forms does."""
    res = {"flashinfer_copies": copies}
    pools = None
    for form in ctx.flashinfer["forms"]:
        dec = Decode(ctx.flashinfer["module"], [c] * batch, shape, ctx.dev, tensor_cores=FORMS[form])
        if pools is None:  # the same pools serve both forms: one page table per batch of lengths
            pools = [dec.random_cache(ctx.dev) for _ in range(copies)]
        out = torch.empty_like(q)
        fns = [lambda p=p, dec=dec, out=out: dec(q, p, out) for p in pools]
        res[f"flashinfer_{form}_ms"] = ctx.time(fns)
        res[f"flashinfer_{form}_stream_ms"] = ctx.stream(fns)
        res[f"flashinfer_{form}_backend"] = dec.backend
        del fns, dec
    best = min(ctx.flashinfer["forms"], key=lambda f: res[f"flashinfer_{f}_ms"])
    ms = res[f"flashinfer_{best}_ms"]
    res.update(flashinfer_form=best, flashinfer_ms=ms, flashinfer_stream_ms=res[f"flashinfer_{best}_stream_ms"],
               flashinfer_bytes_per_s=bf_bytes / (ms * 1e-3))
    if sdpa_ms:
        res["flashinfer_vs_sdpa"] = sdpa_ms / ms
    del pools
    return res


def flashinfer_fields(ctx, c: int, batch: int, shape: dict, q, bf_bytes: int, copies: int, sdpa_ms) -> dict:
    """:func:`time_flashinfer`'s fields, or ``flashinfer_skipped``: one line saying why not."""
    fi = ctx.flashinfer
    if not fi.get("available"):
        return {"flashinfer_skipped": fi["skipped"]}
    try:
        return time_flashinfer(ctx, c, batch, shape, q, bf_bytes, copies, sdpa_ms)
    except Exception as e:  # noqa: BLE001 - one failed shape must not lose the rest of the run
        ctx.empty_cache()
        return {"flashinfer_skipped": f"error {one_line(e)}"}
