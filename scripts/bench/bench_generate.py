"""Benchmark ``model.generate()`` with the real OSCAR cache against transformers' caches.

A random-init Qwen3-8B-shaped model (36 layers, 32 query / 8 KV heads, head_dim 128, bf16; no
weights needed for speed) decodes ``--new`` tokens through ``model.generate()`` after contexts
of 16K / 64K / 128K tokens at batch 1 and 64K at batch 4 and 8, with

* ``dynamic``: ``DynamicCache`` + SDPA (transformers' default, BF16), the baseline;
* ``oscar``: :class:`~oscar_calib.runtime.OscarCache` (BF16 sink 64 + recent 256, INT2 history,
  G = 128; random orthogonal K rotations, clips 0.96/0.92, V folded as ``oscar fold-weights``
  leaves it), decode steps through the Triton INT2 kernel;
* ``quantized``: transformers' ``QuantizedCache`` (quanto, 2 bits) where optimum-quanto imports.

Per run: decode tokens/s (wall, eager), peak ``max_memory_allocated`` during decode, GPU busy
time per decode step (torch profiler: the sum of kernel times, i.e. what the step costs once host
overhead is gone), and GPU time per step replayed from a CUDA graph (``oscar`` vs a
``StaticCache`` + SDPA baseline, both with preallocated static buffers; for ``oscar`` also the
wall tokens/s of a greedy loop through :class:`~oscar_calib.runtime.DecodeGraph`), and decode
tokens/s of ``generate()`` itself after a real prompt (section ``generate``: DynamicCache,
OscarCache eager, OscarCache with ``custom_generate=graph_decoding``; with ``--compile`` also
``DecodeGraph(compile=True)`` and ``graph_decoding`` with ``compile=True``). Contexts for decode runs
are filled with random K/V written through each cache's own write path (the prefill compute is
the same for every cache and would cost minutes of device time); time to first token is measured
separately with real prefills through ``generate(max_new_tokens=1)`` at batch 1. The largest
context that fits is probed by filling caches until an allocation fails (decode of 2 tokens; a
prefill that long would need chunked prefill).

    python scripts/bench/bench_generate.py                 # GPU, writes bench_out/bench_generate.json
    python scripts/bench/bench_generate.py --quick         # tiny model on the CPU (checks the script)

Results go to ``--out`` as JSON after every measurement (a run cut short keeps what it had); the
table printed last is what the docs show.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate_runs import (  # noqa: E402
    QWEN3_8B,
    Results,
    build_model,
    busy_ms,
    decode,
    generate_rate,
    graph_decode,
    graph_ms,
    make_cache,
    max_context,
    ttft,
)


def _free(*objs):
    for o in objs:
        del o
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _attempt(res: Results, where: str, fn):
    """Run ``fn``; an allocation failure is a result (``oom``), anything else is recorded."""
    try:
        return fn()
    except torch.cuda.OutOfMemoryError:
        return {"oom": True}
    except Exception as e:  # noqa: BLE001 - a benchmark records what failed and goes on
        res.add("errors", {"where": where, "error": f"{type(e).__name__}: {e}"[:400]})
        return {"error": f"{type(e).__name__}: {e}"[:200]}
    finally:
        _free()


def decode_record(model, kind, batch, tokens, args) -> dict:
    t0 = time.perf_counter()
    before = torch.cuda.memory_allocated() if model.device.type == "cuda" else 0
    cache = make_cache(kind, model, batch, tokens, args.new + 32, args)
    rec = {"fill_s": time.perf_counter() - t0}
    if model.device.type == "cuda":
        rec["cache_gib"] = (torch.cuda.memory_allocated() - before) / 2**30
    rec.update(decode(model, cache, batch, tokens, args.new))
    rec["busy_ms"] = busy_ms(model, cache, batch, tokens + args.new)
    return rec


def graph_record(model, kind, batch, tokens, args) -> dict:
    cache = make_cache(kind, model, batch, tokens, 32, args)
    rec = {"graph_ms": graph_ms(model, cache, batch, tokens)}
    if kind == "oscar":                                # what a user's loop gets: DecodeGraph, wall clock
        del cache
        gc.collect()
        rec.update(graph_decode(model, batch, tokens, args.new, args))
        if args.compile:                               # the opt-in: the model's own ops through torch.compile
            gc.collect()
            rec.update({f"compiled_{k}": v for k, v in graph_decode(model, batch, tokens, args.new, args,
                                                                     compile=True).items()})
    return rec


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU, short contexts")
    ap.add_argument("--out", type=Path, default=Path("bench_out/bench_generate.json"))
    ap.add_argument("--new", type=int, default=None, help="new tokens per generate (default 128; quick 8)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--fill-chunk", type=int, default=65536, help="tokens written per call when filling")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip what is left after this many seconds")
    ap.add_argument("--sections", default="decode,graph,generate,ttft,maxctx",
                    help="comma-separated: decode, graph, generate, ttft, maxctx")
    ap.add_argument("--compile", action="store_true",
                    help="also time DecodeGraph(compile=True) in the graph section and "
                         "custom_generate=partial(graph_decoding, compile=True) in the generate section")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    import transformers

    args = parse(argv)
    t_start = time.perf_counter()
    dev = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    args.new = args.new or (8 if args.quick else 128)
    if args.quick:
        args.group_size = min(args.group_size, 64)
        configs, ttfts, gens = [(1, 400), (1, 900), (2, 600)], [400, 900], [(1, 400)]
    else:
        configs, ttfts = [(1, 16384), (1, 65536), (1, 131072), (4, 65536), (8, 65536)], [16384, 65536, 131072]
        gens = [(1, 16384), (4, 4096)]
    model = build_model(args.quick, dev)
    meta = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
            "transformers": transformers.__version__, "model": "random-init Qwen3-8B shapes" if not args.quick
            else "tiny random Qwen3", "config": {k: getattr(model.config, k, None) for k in QWEN3_8B},
            "new_tokens": args.new, "group_size": args.group_size, "sink": 64, "recent": 256,
            "weights_gib": torch.cuda.memory_allocated() / 2**30 if dev == "cuda" else None,
            "gpu_total_gib": torch.cuda.get_device_properties(0).total_memory / 2**30 if dev == "cuda" else None}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    kinds = ["dynamic", "oscar"]
    try:
        import optimum.quanto  # noqa: F401

        kinds.append("quantized")
    except ImportError:
        meta["quantized"] = "optimum-quanto is not installed here: transformers' QuantizedCache not measured"
    res = Results(args.out, meta)
    sections = set(args.sections.split(","))

    def late(what):
        if time.perf_counter() - t_start > args.budget_s:
            res.add("errors", {"where": what, "error": "skipped: time budget spent"})
            return True
        return False

    for batch, tokens in configs if sections & {"decode", "graph"} else []:
        for kind in kinds if "decode" in sections else ():
            if kind == "quantized" and batch * tokens > 16384 and not args.quick:
                continue
            if late(f"decode {kind} {batch}x{tokens}"):
                break
            rec = {"batch": batch, "tokens": tokens, "cache": kind}
            rec.update(_attempt(res, f"decode {kind} {batch}x{tokens}",
                                lambda: decode_record(model, kind, batch, tokens, args)))
            res.add("runs", rec)
            print(json.dumps(rec), flush=True)
        for kind in ("static", "oscar") if "graph" in sections and dev == "cuda" else ():
            if late(f"graph {kind} {batch}x{tokens}"):
                break
            rec = {"batch": batch, "tokens": tokens, "cache": f"{kind}+graph"}
            rec.update(_attempt(res, f"graph {kind} {batch}x{tokens}",
                                lambda: graph_record(model, kind, batch, tokens, args)))
            res.add("runs", rec)
            print(json.dumps(rec), flush=True)
    for batch, tokens in gens if "generate" in sections else []:
        for method in ("dynamic", "oscar", "oscar+graph", "oscar+graph+eos") + (("oscar+graph+compile",) * args.compile):
            if late(f"generate {method} {batch}x{tokens}"):
                break
            rec = {"batch": batch, "tokens": tokens, "method": method}
            rec.update(_attempt(res, f"generate {method} {batch}x{tokens}",
                                lambda: generate_rate(model, method, batch, tokens, args.new, args)))
            res.add("generate", rec)
            print(json.dumps(rec), flush=True)
    for tokens in ttfts if "ttft" in sections else []:
        for kind in ("dynamic", "oscar"):
            if late(f"ttft {kind} {tokens}"):
                break
            rec = {"tokens": tokens, "cache": kind}
            rec.update(_attempt(res, f"ttft {kind} {tokens}", lambda: ttft(model, kind, tokens, args)))
            res.add("ttft", rec)
            print(json.dumps(rec), flush=True)
    for kind in ("dynamic", "oscar") if "maxctx" in sections and dev == "cuda" else ():
        if late(f"max context {kind}"):
            break
        res.add("max_context", {kind: _attempt(res, f"max context {kind}", lambda: max_context(model, kind, args))})
    res.data["meta"]["elapsed_s"] = time.perf_counter() - t_start
    res.add("max_context", {})                     # (writes the file with the elapsed time)
    print(table(res.data))
    return res.data


def _ctx(t: int) -> str:
    return f"{t // 1024}K" if t >= 1024 else str(t)


def _fmt(x, spec=".1f"):
    return "–" if x is None else format(x, spec)


def table(data: dict) -> str:
    """The README table: one row per (batch, context), eager and CUDA-graph columns per cache."""
    runs = {(r["batch"], r["tokens"], r["cache"]): r for r in data["runs"]}
    keys = sorted({(b, t) for b, t, _ in runs})
    lines = ["| batch × context | cache | decode tok/s (eager) | ms/step wall | GPU busy ms/step | CUDA-graph ms/step "
             "| decode peak GiB |", "|---|---|---|---|---|---|---|"]
    for b, t in keys:
        for kind, graph in (("dynamic", "static+graph"), ("oscar", "oscar+graph"), ("quantized", None)):
            g = runs.get((b, t, graph), {}) if graph else {}
            r = runs.get((b, t, kind), {} if g else None)     # (a graph-only run: the eager columns empty)
            if r is None:
                continue
            gms = "OOM" if g.get("oom") else _fmt(g.get("graph_ms"), ".2f")
            if g.get("graph_tok_s"):
                gms += f" ({g['graph_tok_s']:.1f} tok/s with DecodeGraph"
                if g.get("compiled_graph_tok_s"):
                    gms += f"; {g['compiled_graph_tok_s']:.1f} compiled, {g['compiled_graph_wall_ms_per_step']:.2f} ms/step"
                gms += ")"
            if r.get("oom"):
                lines.append(f"| {b} × {_ctx(t)} | {kind} | OOM | | | {gms} | |")
                continue
            lines.append(f"| {b} × {_ctx(t)} | {kind} | {_fmt(r.get('tok_s'))} | {_fmt(r.get('ms_per_step'))} | "
                         f"{_fmt(r.get('busy_ms'), '.2f')} | {gms} | {_fmt(r.get('peak_gib'), '.2f')} |")
    for r in data.get("generate", []):
        if "generate_tok_s" in r:
            lines.append(f"| generate() {r['batch']} × {_ctx(r['tokens'])} | {r['method']} | "
                         f"{_fmt(r['generate_tok_s'])} | | | | |")
    for r in data["ttft"]:
        if "ttft_s" in r:
            lines.append(f"| TTFT 1 × {_ctx(r['tokens'])} | {r['cache']} | {r['ttft_s']:.2f} s | | | | "
                         f"{_fmt(r.get('prefill_peak_gib'), '.2f')} (prefill) |")
    for kind, r in data["max_context"].items():
        if isinstance(r, dict) and r.get("max_tokens"):
            lines.append(f"| max context, batch 1 | {kind} | {r['max_tokens']:,} tokens | | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
