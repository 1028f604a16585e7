"""Benchmark ``model.generate()`` with the real OSCAR cache against transformers' caches.

A random-init Qwen3-8B-shaped model (36 layers, 32 query / 8 KV heads, head_dim 128, bf16; no
weights needed for speed) decodes ``--new`` tokens through ``model.generate()`` after contexts
of 16K / 64K / 128K tokens at batch 1 and 64K at batch 4 and 8, with

* ``dynamic``: ``DynamicCache`` + SDPA (transformers' default, BF16);
* ``oscar``: :class:`~oscar_calib.runtime.OscarCache` (BF16 sink 64 + recent 256, INT2 history,
  G = 128; random orthogonal K rotations, clips 0.96/0.92, V folded as ``oscar fold-weights``
  leaves it), decode steps through the Triton INT2 kernel;
* ``quantized``: transformers' ``QuantizedCache`` (quanto, 2 bits) where optimum-quanto imports.

Per run: decode tokens/s (wall, eager), peak ``max_memory_allocated`` during decode, GPU busy
time per decode step (torch profiler: the sum of kernel times, i.e. what the step costs once host
overhead is gone), and GPU time per step replayed from a CUDA graph (``oscar`` and
``StaticCache`` + SDPA, both with preallocated static buffers; for ``oscar`` also the
wall tokens/s of a greedy loop through :class:`~oscar_calib.runtime.DecodeGraph`), and decode
tokens/s of ``generate()`` itself after a real prompt (section ``generate``: DynamicCache,
OscarCache eager, OscarCache with ``custom_generate=graph_decoding``; with ``--compile`` also
``DecodeGraph(compile=True)`` and ``graph_decoding`` with ``compile=True``). Contexts for decode runs
are filled with random K/V written through each cache's own write path (the prefill compute is
the same for every cache and would cost minutes of device time); time to first token is measured
separately with real prefills through ``generate(max_new_tokens=1)`` at batch 1. The largest
context that fits is probed by filling caches until an allocation fails (decode of 2 tokens; a
prefill that long would need chunked prefill).

    python scripts/bench/bench_generate.py                    # GPU, writes bench_out/generate-DEVICE.json
    python scripts/bench/bench_generate.py --sections graph --save   # one section, accepted as current
    python scripts/bench/bench_generate.py --quick            # tiny model on the CPU (checks the script)

The result (``harness.py``'s format; sections ``rows`` (eager decode), ``graph``, ``generate``,
``ttft``, ``max_context``) is written to ``--out`` after every measurement (a run cut short keeps
what it had), and with ``--save`` installed as the current result at the end; the tables of
docs/benchmarks.md (``report.py``) are printed last. ``StaticCache`` + SDPA is transformers' stock
path for a static cache, slow at decode: a reference point, not a baseline for speed-ups.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:  # imported rather than run (the tests)
    sys.path.append(str(Path(__file__).resolve().parent))

import report  # noqa: E402
from bench_generate_runs import (  # noqa: E402
    QWEN3_8B,
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
from harness import add_output_args, describe_device, new_result, out_dir, write_result  # noqa: E402

SECTIONS = {"fair": "fair", "profile": "profile", "capacity": "capacity", "decode": "rows", "graph": "graph", "generate": "generate", "ttft": "ttft", "maxctx": "max_context"}
QUICK_WINDOW = (8, 16)  # --quick: sink, recent (contexts of ~100 tokens still reach the INT2 history)


class Results:
    """The result document, written to ``folder`` after every measurement."""

    def __init__(self, doc: dict, folder: Path):
        self.data, self.folder = doc, folder

    def add(self, section: str, item) -> None:
        if isinstance(self.data[section], list):
            self.data[section].append(item)
        else:
            self.data[section].update(item)
        write_result(self.data, save=False, out=self.folder)


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
    add_output_args(ap)
    ap.add_argument("--new", type=int, default=None, help="new tokens per generate (default 128; quick 4)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--fill-chunk", type=int, default=65536, help="tokens written per call when filling")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip what is left after this many seconds")
    ap.add_argument("--sections", default="fair,decode,graph,generate,ttft,maxctx",
                    help="comma-separated: fair (the fair BF16 baseline and each step's roofline), capacity "
                         "(sequences of 128K per GPU), profile (kernel time by category), decode, graph, "
                         "generate, ttft, maxctx")
    ap.add_argument("--compile", action="store_true",
                    help="also time DecodeGraph(compile=True) in the graph section and "
                         "custom_generate=partial(graph_decoding, compile=True) in the generate section")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    sections = set(args.sections.split(","))
    if not sections <= set(SECTIONS):
        raise SystemExit(f"error: --sections takes {', '.join(SECTIONS)}, got {args.sections!r}")
    if args.save and args.quick:
        raise SystemExit("error: --save accepts a GPU run only, not --quick")
    t_start = time.perf_counter()
    dev = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    args.new = args.new or (4 if args.quick else 128)
    args.window = QUICK_WINDOW if args.quick else (64, 256)
    if args.quick:
        args.group_size = min(args.group_size, 64)
        configs, ttfts, gens = [(1, 96), (2, 64)], [96], [(1, 64)]
    else:
        configs, ttfts = [(1, 16384), (1, 65536), (1, 131072), (4, 65536), (8, 65536)], [16384, 65536, 131072]
        gens = [(1, 16384), (4, 4096)]
    model = build_model(args.quick, dev)
    settings = {"model": "random-init Qwen3-8B shapes" if not args.quick else "tiny random Qwen3",
                "config": {k: getattr(model.config, k, None) for k in QWEN3_8B}, "new_tokens": args.new,
                "group_size": args.group_size, "sink": args.window[0], "recent": args.window[1],
                "sections": sorted(sections), "compile": args.compile, "quick": args.quick}
    doc = new_result("generate", describe_device(cuda=dev == "cuda"), script=__file__, argv=argv, settings=settings)
    doc.update(fair=[], profile=[], capacity=[], graph=[], generate=[], ttft=[], max_context={}, errors=[],
               not_measured=[key for sec, key in SECTIONS.items() if sec not in sections],
               weights_gib=torch.cuda.memory_allocated() / 2**30 if dev == "cuda" else None,
               gpu_total_gib=torch.cuda.get_device_properties(0).total_memory / 2**30 if dev == "cuda" else None)
    kinds = ["dynamic", "oscar"]
    try:
        import optimum.quanto  # noqa: F401

        kinds.append("quantized")
    except ImportError:
        doc["quantized"] = "optimum-quanto is not installed here: transformers' QuantizedCache not measured"
    folder = out_dir(args)
    res = Results(doc, folder)

    def late(what):
        if time.perf_counter() - t_start > args.budget_s:
            res.add("errors", {"where": what, "error": "skipped: time budget spent"})
            return True
        return False

    fair_configs = [(1, 16384), (1, 65536), (1, 131072), (4, 65536)]
    if dev == "cuda" and sections & {"fair", "capacity", "profile"}:
        from bench_generate_fair import (
            capacity,
            copy_bandwidth,
            fair_record,
            flashinfer_baseline,
            profile_record,
        )

        res.data["copy_bandwidth"] = copy_bandwidth()
        if "fair" in sections:
            res.data["flashinfer"] = _attempt(res, "flashinfer", lambda: flashinfer_baseline(model))
            print(json.dumps({"flashinfer": res.data["flashinfer"]}), flush=True)
        fi_forms = res.data.get("flashinfer", {}).get("forms", [])
        for batch, tokens in fair_configs if "fair" in sections else []:
            if late(f"fair {batch}x{tokens}"):
                break
            rec = {"batch": batch, "tokens": tokens}
            rec.update(_attempt(res, f"fair {batch}x{tokens}",
                                lambda: fair_record(model, batch, tokens, args, res.data["copy_bandwidth"],
                                                                  fi_forms)))
            res.add("fair", rec)
            print(json.dumps(rec), flush=True)
        for batch, tokens in [(1, 16384), (1, 131072)] if "profile" in sections else []:
            if late(f"profile {batch}x{tokens}"):
                break
            res.add("profile", _attempt(res, f"profile {batch}x{tokens}",
                                        lambda: profile_record(model, batch, tokens, args)))
        if "capacity" in sections and not late("capacity"):
            res.add("capacity", _attempt(res, "capacity", lambda: capacity(model, 131072, args)))
    for batch, tokens in configs if sections & {"decode", "graph"} else []:
        for kind in kinds if "decode" in sections else ():
            if kind == "quantized" and batch * tokens > 16384 and not args.quick:
                continue
            if late(f"decode {kind} {batch}x{tokens}"):
                break
            rec = {"batch": batch, "tokens": tokens, "cache": kind}
            rec.update(_attempt(res, f"decode {kind} {batch}x{tokens}",
                                lambda: decode_record(model, kind, batch, tokens, args)))
            res.add("rows", rec)
            print(json.dumps(rec), flush=True)
        for kind in ("static", "oscar") if "graph" in sections and dev == "cuda" else ():
            if late(f"graph {kind} {batch}x{tokens}"):
                break
            rec = {"batch": batch, "tokens": tokens, "cache": f"{kind}+graph"}
            rec.update(_attempt(res, f"graph {kind} {batch}x{tokens}",
                                lambda: graph_record(model, kind, batch, tokens, args)))
            res.add("graph", rec)
            print(json.dumps(rec), flush=True)
    for batch, tokens in gens if "generate" in sections else []:
        methods = ("dynamic", "oscar", "oscar+graph", "oscar+graph+eos") + (("oscar+graph+compile",) * args.compile)
        for method in methods:
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
    res.data["elapsed_s"] = time.perf_counter() - t_start
    res.add("max_context", {})                     # (writes the file with the elapsed time)
    if args.save:
        print(f"current result: {write_result(res.data, save=True, out=folder)}")
    print("\n".join(report.generate(res.data)))
    return res.data


if __name__ == "__main__":
    main()
