"""Benchmark one decode step's cache write: ``kernels.append_token`` (one Triton launch) against its
pure-torch reference (the torch ops a decode step ran before it; its quantiser is the reference's,
not the write kernel, so treat the ratio as an order of magnitude).

Qwen3-8B shapes per layer (8 KV heads, head_dim 128, G = 128, sink 64 + recent 256, bf16
window), 36 layers per step: a CUDA graph holds one call per layer, each into its own layer's
buffers, and the median replay over 36 is the time per call (launch gaps included, L2 warm).
Variants: the defaults; without clip, without rotation, without both (the floor of a launch that
moves the same bytes); other ``KB`` (rows of ``R`` per product step) and warp counts.

The ``step`` section (``--sections step``) times a decode step's attention per layer, the write
and the decode kernel together, over a filled cache of ``--contexts`` tokens (36 layers, each its
own cache, so L2 holds none of it), with the query rotated three ways: by the decode call's own
rotation kernel (``rotation kernel``: the runtime before), by ``append_token``'s K programs with
the decode kernel launched while the write ends (``in append_token``: the runtime now,
``pdl_input=True``), and the same without that overlap (``in append_token, no PDL``). Three
alternating rounds, medians; the outputs of the three are compared. For scale, the same step
with a static BF16 cache (``BF16 cache + SDPA``: the row written at a device position, then
``scaled_dot_product_attention`` over the context; fewer layers where 36 would not fit).

    python scripts/bench/bench_append.py                     # GPU, ~1 min; bench_out/append-DEVICE.json
    python scripts/bench/bench_append.py --save              # the same, accepted as the current result
    python scripts/bench/bench_append.py --sections step     # one section (--save keeps the other's figures)
    python scripts/bench/bench_append.py --quick             # CPU check of the script (Triton interpreter)

Prints a table (microseconds per call) and writes the result JSON (``harness.py``: device, commit,
date, command, versions); timing is ``harness.graph_ms`` with L2 warm (``flush="none"``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:  # imported rather than run (the tests)
    sys.path.append(str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    add_output_args,
    describe_device,
    graph_ms,
    new_result,
    out_dir,
    quick_interpreter,
    run_program,
    write_result,
)

from oscar_calib.kernels import decode_attention  # noqa: E402
from oscar_calib.kernels.append import append_token, decode_view  # noqa: E402
from oscar_calib.kernels.testing import random_rotation  # noqa: E402

VARIANTS = {
    "default": {},
    "no clip": {"clip": None},
    "no rotation": {"rotation": None},
    "neither": {"clip": None, "rotation": None},
    "KB 32": {"config": {"KB": 32}},
    "KB 64, 2 warps": {"config": {"KB": 64, "num_warps": 2}},
    "torch reference": {"backend": "torch"},
}


def layer_buffers(batch, heads, d, sink, recent, cap, device):
    z = dict(device=device)
    return dict(window=torch.zeros(batch, 2, heads, sink + recent + 1, d, dtype=torch.bfloat16, **z),
                codes=torch.zeros(batch, 2, heads, cap + 1, d // 4, dtype=torch.uint8, **z),
                scale=torch.zeros(batch, 2, heads, cap + 1, 1, dtype=torch.float16, **z),
                offset=torch.zeros(batch, 2, heads, cap + 1, 1, dtype=torch.float16, **z),
                counts=torch.full((batch,), 1000, **z),
                lens=(torch.zeros(batch, dtype=torch.int32, **z), torch.zeros(batch, dtype=torch.int32, **z)),
                ticket=torch.zeros(batch, dtype=torch.int32, **z))


def time_step(fn, reps: int, cuda: bool) -> float:
    """Median seconds of ``fn`` (one decode step's calls), replayed from a CUDA graph on a GPU, L2 warm."""
    return graph_ms(fn, cuda=cuda, flush="none", warmup=1, reps=reps, cpu_reps=reps) / 1e3


STEP_METHODS = ("rotation kernel", "in append_token", "in append_token, no PDL")
STEP_ROUNDS = 3


def filled_layer(batch, heads, d, sink, recent, context, device, gen):
    """One layer's buffers holding ``context`` tokens of random codes, parameters and window rows,
    with room for the benchmark's steps, and the decode kernel's view of them."""
    b = layer_buffers(batch, heads, d, sink, recent, context - sink + 1024, device)
    b["codes"].random_(0, 256, generator=gen)
    b["scale"].uniform_(0.01, 0.1, generator=gen)
    b["offset"].uniform_(-0.2, 0.0, generator=gen)
    b["window"].normal_(generator=gen)
    b["counts"].fill_(context)
    b["lens"][0].fill_(sink + recent)
    b["lens"][1].fill_(context - sink - recent)
    b["view"] = decode_view(b["window"], b["codes"], b["scale"], b["offset"], b["lens"], d)
    return b


def step_section(a, reps, rot, clip, heads, d, sink, recent, cuda, dev) -> list[dict]:
    """Write + decode per layer, the query rotated by the decode call or by ``append_token``."""
    shapes = [(1, 32768), (1, 131072), (8, 131072), (32, 32768)] if cuda else [(1, 200)]
    if a.contexts:
        shapes = [(int(bs), int(c)) for bs, c in (x.split("x") for x in a.contexts.split(","))]
    qg = 4
    rk = rot[:heads].contiguous()
    rows = []
    for batch, ctx in shapes:
        per_layer = batch * ctx * 2 * heads * (d // 4 + 4)
        layers = max(2, min(a.layers, int(a.step_bytes // per_layer))) if cuda else 1
        gen = torch.Generator(device=dev).manual_seed(0)
        bufs = [filled_layer(batch, heads, d, sink, recent, ctx, dev, gen) for _ in range(layers)]
        k = torch.randn(batch, heads, d, device=dev).to(torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(batch, heads * qg, d, device=dev).to(torch.bfloat16)
        outs = {m: [torch.empty(batch, heads * qg, d, dtype=torch.bfloat16, device=dev) for _ in bufs]
                for m in STEP_METHODS}
        kw = dict(sink=sink, recent=recent, group_size=d, rotation=rot, clip=clip, backend="triton")

        def step(method, layers_=None):
            for b, out in layers_ or zip(bufs, outs[method]):
                if method == "rotation kernel":
                    append_token(k, v, b["window"], b["codes"], b["scale"], b["offset"], b["counts"],
                                 lens=b["lens"], ticket=b["ticket"], **kw)
                    decode_attention(q, b["view"], k_rotation=rk, out=out, check_lengths=False, backend="triton")
                else:
                    qr = append_token(k, v, b["window"], b["codes"], b["scale"], b["offset"], b["counts"],
                                      lens=b["lens"], ticket=b["ticket"], query=q, **kw)
                    decode_attention(qr, b["view"], k_rotation=None, out=out, check_lengths=False, backend="triton",
                                     pdl_input=method == "in append_token")

        # the three agree: one step of each from copies of the same filled layer
        got = {}
        for m in STEP_METHODS:
            b0 = {n: (tuple(t.clone() for t in x) if isinstance(x, tuple) else x.clone())
                  for n, x in bufs[0].items() if n != "view"}
            b0["view"] = decode_view(b0["window"], b0["codes"], b0["scale"], b0["offset"], b0["lens"], d)
            got[m] = torch.empty_like(outs[m][0])
            step(m, [(b0, got[m])])
        base = got[STEP_METHODS[0]].float()
        times = {m: [] for m in STEP_METHODS}
        for _ in range(STEP_ROUNDS if cuda else 1):
            for m in STEP_METHODS:
                times[m].append(1e6 * time_step(lambda m=m: step(m), reps, cuda) / layers)
        for m in STEP_METHODS:
            us = statistics.median(times[m])
            err = ((got[m].float() - base).norm() / base.norm()).item()
            rows.append({"batch": batch, "context": ctx, "method": m, "layers": layers, "us_per_layer": us,
                         "rounds_us": times[m], "rel_diff_vs_rotation_kernel": err})
            print(f"batch {batch:3d} x {ctx:6d}  {m:24s} {us:8.2f} us per layer (write + decode)  "
                  f"rel diff {err:.1e}", flush=True)
        bufs.clear()                                   # (free the layers before the next shape)
        outs.clear()
        if cuda:
            torch.cuda.empty_cache()
        us, layers_bf = sdpa_step(a, reps, batch, ctx, heads, qg, d, cuda, dev)
        rows.append({"batch": batch, "context": ctx, "method": "BF16 cache + SDPA", "layers": layers_bf,
                     "us_per_layer": us, "rel_diff_vs_rotation_kernel": None})
        print(f"batch {batch:3d} x {ctx:6d}  {'BF16 cache + SDPA':24s} {us:8.2f} us per layer (write + attention)",
              flush=True)
    return rows


def sdpa_step(a, reps, batch, ctx, heads, qg, d, cuda, dev) -> tuple[float, int]:
    """The same step with a static BF16 cache, as transformers' StaticCache + SDPA run it: the new
    K/V row written at a device position (``index_copy_``), then SDPA over ``ctx`` cached tokens."""
    per_layer = batch * heads * ctx * d * 2 * 2
    layers = max(1, min(a.layers, int(a.step_bytes // per_layer))) if cuda else 1
    caches = [(torch.randn(batch, heads, ctx + 8, d, device=dev).to(torch.bfloat16),
               torch.randn(batch, heads, ctx + 8, d, device=dev).to(torch.bfloat16)) for _ in range(layers)]
    k = torch.randn(batch, heads, 1, d, device=dev).to(torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, heads * qg, 1, d, device=dev).to(torch.bfloat16)
    pos = torch.tensor([ctx - 1], device=dev)

    def step():
        for kc, vc in caches:
            kc.index_copy_(2, pos, k)
            vc.index_copy_(2, pos, v)
            torch.nn.functional.scaled_dot_product_attention(q, kc[:, :, :ctx], vc[:, :, :ctx], enable_gqa=True)

    times = [1e6 * time_step(step, reps, cuda) / layers for _ in range(STEP_ROUNDS if cuda else 1)]
    caches.clear()
    if cuda:
        torch.cuda.empty_cache()
    return statistics.median(times), layers


NO_GPU = ("error: no CUDA device here; the benchmark needs a GPU (--quick runs a CPU smoke test under the Triton "
          "interpreter)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="CPU, one small layer, batch 1, one timed call (checks the script)")
    add_output_args(ap)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sections", default="append,step", help="comma-separated: append (the write alone), "
                    "step (write + decode, the query rotated by the decode call or by append_token)")
    ap.add_argument("--contexts", default="", help="step section: BATCHxCONTEXT list (default "
                    "1x32768,1x131072,8x131072,32x32768)")
    ap.add_argument("--step-bytes", type=float, default=16e9,
                    help="step section: INT2 history bytes over all layers at most (fewer layers at large shapes)")
    a = ap.parse_args(argv)
    sections = set(a.sections.split(","))
    if not sections <= {"append", "step"}:
        raise SystemExit(f"error: --sections takes append and step, got {a.sections!r}")
    if a.save and a.quick:
        raise SystemExit("error: --save accepts a GPU run only, not --quick")
    if not torch.cuda.is_available() and not a.quick:
        raise SystemExit(NO_GPU)
    cuda = not a.quick
    if a.quick:
        quick_interpreter()
    torch.manual_seed(0)
    dev = "cuda" if cuda else "cpu"
    heads, d, sink, recent = (8, 128, 64, 256) if not a.quick else (1, 64, 4, 8)
    layers, reps = (a.layers, a.reps) if not a.quick else (1, 1)
    batches = [int(b) for b in a.batches.split(",")] if not a.quick else [1]
    device = describe_device(cuda=cuda)
    settings = {"layers": layers, "heads": heads, "head_dim": d, "group_size": d, "sink": sink, "recent": recent,
                "batches": batches, "reps": reps, "sections": sorted(sections), "quick": a.quick}
    res = new_result("append", device, script=__file__, argv=argv, settings=settings)
    rot = random_rotation(2 * heads, d, generator=torch.Generator().manual_seed(0)).float().to(dev)
    clip = torch.full((2 * heads,), 0.92, device=dev)
    rows = res["rows"]
    for batch in (batches if "append" in sections else []):
        bufs = [layer_buffers(batch, heads, d, sink, recent, 4096 if cuda else 64, dev) for _ in range(layers)]
        k = torch.randn(batch, heads, d, dtype=torch.bfloat16, device=dev)
        v = torch.randn_like(k)
        for variant, over in VARIANTS.items():
            kw = {"rotation": rot, "clip": clip, "backend": "triton"}
            kw.update(over)

            def step():
                for b in bufs:
                    append_token(k, v, b["window"], b["codes"], b["scale"], b["offset"], b["counts"],
                                 sink=sink, recent=recent, group_size=d, lens=b["lens"], ticket=b["ticket"], **kw)

            us = 1e6 * time_step(step, reps, cuda) / layers
            rows.append({"batch": batch, "variant": variant, "us_per_call": us})
            print(f"batch {batch:3d}  {variant:16s} {us:8.2f} us per call", flush=True)
    res["step"] = step_section(a, reps, rot, clip, heads, d, sink, recent, cuda, dev) if "step" in sections else []
    res["not_measured"] = [k for k, sec in (("rows", "append"), ("step", "step")) if sec not in sections]
    path = write_result(res, save=a.save, out=out_dir(a))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    run_program(main)
