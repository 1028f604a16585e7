"""Benchmark one decode step's cache write: ``kernels.append_token`` (one Triton launch) against its
pure-torch reference (the torch ops a decode step ran before it; its quantiser is the reference's,
not the write kernel, so treat the ratio as an order of magnitude).

Qwen3-8B shapes per layer (8 KV heads, head_dim 128, G = 128, sink 64 + recent 256, bf16
window), 36 layers per step: a CUDA graph holds one call per layer, each into its own layer's
buffers, and the median replay over 36 is the time per call (launch gaps included, L2 warm).
Variants: the defaults; without clip, without rotation, without both (the floor of a launch that
moves the same bytes); other ``KB`` (rows of ``R`` per product step) and warp counts.

    python scripts/bench_append.py --out scripts/results/bench_append_h200.json      # GPU, ~30 s
    python scripts/bench_append.py --quick                                             # CPU check

Prints a table (microseconds per call) and writes JSON with the device's name.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oscar_calib.fsutil import atomic_write_text  # noqa: E402
from oscar_calib.kernels.append import append_token  # noqa: E402
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
    """Median seconds of ``fn`` (one decode step's calls), replayed from a CUDA graph on a GPU."""
    if not cuda:
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU, 2 layers, batch 1 (checks the script)")
    ap.add_argument("--out", type=Path, default=Path("bench_out/bench_append.json"))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available() and not a.quick:
        print("error: no CUDA device here; the benchmark needs a GPU (--quick runs a CPU smoke test under "
              "the Triton interpreter)", file=sys.stderr)
        return 2
    cuda = not a.quick
    if a.quick:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dev = "cuda" if cuda else "cpu"
    heads, d, sink, recent = (8, 128, 64, 256) if not a.quick else (2, 64, 4, 8)
    layers, reps = (a.layers, a.reps) if not a.quick else (2, 2)
    batches = [int(b) for b in a.batches.split(",")] if not a.quick else [1]
    name = torch.cuda.get_device_name() if cuda else "cpu"
    rot = random_rotation(2 * heads, d, generator=torch.Generator().manual_seed(0)).float().to(dev)
    clip = torch.full((2 * heads,), 0.92, device=dev)
    rows = []
    for batch in batches:
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
    res = {"device": name, "torch": torch.__version__, "layers": layers, "heads": heads, "head_dim": d,
           "rows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(a.out, json.dumps(res, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
