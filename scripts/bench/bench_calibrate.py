#!/usr/bin/env python
"""Calibration cost: capture+accumulate overhead vs a plain forward pass, and peak memory at two
token budgets.

    python scripts/bench/bench_calibrate.py                      # SmolLM2-135M on the CPU, 8K vs 64K tokens
    python scripts/bench/bench_calibrate.py --budgets 4096,16384 --repeats 3
    python scripts/bench/bench_calibrate.py --gpu                # Qwen3-8B geometry, random init, bf16, on CUDA

``--gpu`` (see gpu_main): a random-init model with Qwen3-8B's geometry (36 layers, hidden 4096, 32/8
heads, head_dim 128, intermediate 12288, vocab 151936) in bf16 with sdpa, on GPU 0; calibration text
is the embedded corpus through a byte tokenizer (ids 1..256, EOS 0: real text structure, the model
is random anyway; timing does not depend on the ids). It measures, in one process: wall time,
tokens/s and the capture+accumulate overhead vs a plain forward (same batches, alternating, medians)
at 30K tokens for two batch shapes; peak GPU memory beyond the weights at 8K vs 64K tokens; the
accumulator update alone on synthetic activations; and, when two or more GPUs are visible, the
same 30K-token statistics with 2 data-parallel ranks (NCCL) launched through oscar's launcher: wall
time, speed-up, and the relative difference of the all-reduced accumulators vs one GPU.

What is measured (one process per budget, so peak RSS is that budget's own):
* ``plain``: forward passes over the calibration batches (``use_cache=False``), no capture.
* ``capture``: the same passes through ``collect_statistics`` (capture, float64 accumulators,
  per-batch finiteness checks), checkpointing off.
Both are timed alternately ``--repeats`` times; the medians give the overhead ratio.
Peak memory: ``ru_maxrss`` of the process (CPU) or ``torch.cuda.max_memory_allocated`` minus the
weights (GPU). Writes ``calibrate-DEVICE.json`` (``harness.py``'s format) to ``--out`` (default
``$OUT`` or ./bench_out), with ``--save`` also as the current result, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # imported rather than run (the tests)
    sys.path.append(str(Path(__file__).resolve().parent))

from harness import add_output_args, describe_device, new_result, out_dir, write_result  # noqa: E402


def one_budget(model: str, tokens: int, seq_len: int, batch_size: int, repeats: int, device: str) -> dict:
    import torch

    from oscar_calib.calibration.collect import collect_statistics
    from oscar_calib.calibration.pipeline import prepare_model
    from oscar_calib.contract.config import CalibrationConfig
    from oscar_calib.data.corpus import plan_tokens

    cfg = CalibrationConfig(model=model, tokens=tokens, seq_len=seq_len, batch_size=batch_size, device=device,
                            dtype="float32" if device == "cpu" else "bfloat16")
    lm = prepare_model(cfg)
    data = "embedded"
    plan = plan_tokens(lm.tokenizer, data=data, tokens=tokens, seq_len=seq_len, heldout_tokens=cfg.heldout_tokens,
                       heldout_seqs=1, seed=0)
    if plan.tokens < tokens:
        raise SystemExit(f"only {plan.tokens} tokens available")
    batches = plan.batches(batch_size)
    dev = next(lm.model.parameters()).device
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    weights = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    from oscar_calib.model.capture import capture_forward as _forward

    def plain():          # the same forward the pipeline runs (no KV cache, last-position logits only)
        with torch.no_grad():
            for b in batches:
                _forward(lm.model, b.to(dev))
        sync()

    from oscar_calib.data.corpus import TokenPlan

    stream_only = TokenPlan(plan.calibration, [], plan.source)   # the fixed held-out capture is not streaming

    def capture():
        collect_statistics(lm, stream_only, cfg)
        sync()

    plain()   # warm-up
    times = {"plain": [], "capture": []}
    for _ in range(repeats):
        for name, fn in (("plain", plain), ("capture", capture)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    # capture() streams the calibration batches only (no held-out capture): the same tokens as plain()
    med = {k: statistics.median(v) for k, v in times.items()}
    peak = (torch.cuda.max_memory_allocated() - weights) if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"tokens": plan.tokens, "seq_len": seq_len, "batch_size": batch_size, "device": str(dev),
            "median_plain_s": med["plain"], "median_capture_s": med["capture"],
            "overhead": med["capture"] / med["plain"] - 1, "tokens_per_s_capture": plan.tokens / med["capture"],
            "peak_bytes": peak, "peak_kind": "cuda allocated beyond weights" if cuda else "process max RSS",
            "times": times}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--budgets", default="8192,65536", help="comma-separated token budgets")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--gpu", action="store_true", help="benchmark a Qwen3-8B-geometry model on CUDA (see above)")
    ap.add_argument("--no-dp", action="store_true", help="with --gpu: skip the 2-rank data-parallel measurement")
    ap.add_argument("--gpu-device", default="cuda", help=argparse.SUPPRESS)   # cpu: dry run of --gpu (with --small)
    ap.add_argument("--small", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)   # child mode: one budget, JSON on stdout
    ap.add_argument("--dp-worker", help=argparse.SUPPRESS)       # child mode: one data-parallel rank
    add_output_args(ap)
    args = ap.parse_args(argv)
    if args.dp_worker:
        return dp_worker(json.loads(args.dp_worker))
    if args.save and args.small:
        raise SystemExit("error: --save accepts a real run only, not --small")
    if args.gpu:
        return gpu_main(args, argv)
    if args.one:
        res = one_budget(args.model, args.one, args.seq_len, args.batch_size, args.repeats, args.device)
        print("RESULT " + json.dumps(res))
        return
    results = []
    for b in [int(x) for x in args.budgets.split(",")]:
        cmd = [sys.executable, __file__, "--one", str(b), "--model", args.model, "--seq-len", str(args.seq_len),
               "--batch-size", str(args.batch_size), "--repeats", str(args.repeats), "--device", args.device]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            sys.exit(f"budget {b} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(line[0][7:]))
    lo, hi = results[0]["peak_bytes"], results[-1]["peak_bytes"]
    settings = {"model": args.model, "budgets": [r["tokens"] for r in results], "seq_len": args.seq_len,
                "batch_size": args.batch_size, "repeats": args.repeats, "device": args.device}
    doc = new_result("calibrate", describe_device(cuda=False), script=__file__, argv=argv, settings=settings)
    doc.update(rows=results, memory_growth=hi / lo - 1)
    print(f"wrote {write_result(doc, save=args.save, out=out_dir(args))}")
    print(f"\n{'tokens':>8} {'plain s':>9} {'capture s':>10} {'overhead':>9} {'tok/s':>8} {'peak MiB':>9}")
    for r in results:
        print(f"{r['tokens']:>8} {r['median_plain_s']:>9.2f} {r['median_capture_s']:>10.2f} {r['overhead']:>8.1%} "
              f"{r['tokens_per_s_capture']:>8.0f} {r['peak_bytes'] / 2**20:>9.0f}")
    print(f"peak memory growth {results[0]['tokens']} -> {results[-1]['tokens']} tokens: {doc['memory_growth']:+.1%} "
          f"({results[0]['peak_kind']})")


# ----------------------------------------------------------------------------- --gpu

GPU_TOKENS = 30720                 # "30K": 15 sequences of 2048
SHAPES = [(2048, 2), (1024, 1)]    # (seq_len, batch_size): the first is used for memory and data parallelism
MEM_BUDGETS = (8192, 65536)
DEV = "cuda"                       # --gpu-device cpu --small: the same code on a tiny model (a dry run on the CPU)
SMALL = False


def _cuda() -> bool:
    return DEV.startswith("cuda")


def _sync() -> None:
    import torch

    if _cuda():
        torch.cuda.synchronize()


def _allocated(device=None) -> int:
    import torch

    return torch.cuda.memory_allocated(device) if _cuda() else 0


def _reset_peak() -> None:
    import torch

    if _cuda():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak() -> int:
    import torch

    return torch.cuda.max_memory_allocated() if _cuda() else 0


def _small(args) -> None:
    global GPU_TOKENS, SHAPES, MEM_BUDGETS, DEV, SMALL
    DEV = args.gpu_device
    if args.small:
        SMALL, GPU_TOKENS, SHAPES, MEM_BUDGETS = True, 2048, [(256, 2), (128, 1)], (1024, 4096)


class ByteTokenizer:
    """UTF-8 bytes as ids 1..256, EOS 0 (the random model's vocab is 151936; ids are irrelevant to speed)."""

    eos_token_id = 0
    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [b + 1 for b in text.encode()]}


def qwen3_8b_geometry(device: str):
    """(LoadedModel, weight bytes) of a random-init bf16 model with Qwen3-8B's shapes on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from oscar_calib.model.geometry import geometry_of, model_fingerprint
    from oscar_calib.model.load import LoadedModel
    from oscar_calib.model.source import ModelSource

    geo = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    if SMALL:
        geo = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    cfg = Qwen3Config(**geo, max_position_embeddings=40960, rope_theta=1_000_000, tie_word_embeddings=False,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    before = _allocated(device)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    _sync()
    src = ModelSource(spec="qwen3-8b-geometry", model_id="random-init/Qwen3-8B-geometry", path="", kind="local")
    lm = LoadedModel(model, ByteTokenizer(), src, geometry_of(model), model_fingerprint(model))
    return lm, _allocated(device) - before


def gpu_plan(tokens: int, seq_len: int):
    from oscar_calib.data.corpus import plan_tokens

    plan = plan_tokens(ByteTokenizer(), data="embedded", tokens=tokens, seq_len=seq_len, heldout_tokens=512,
                       heldout_seqs=1, seed=0)
    assert plan.tokens == tokens, plan.tokens
    return plan


def gpu_cfg(tokens: int, seq_len: int, batch_size: int):
    from oscar_calib.contract.config import CalibrationConfig

    return CalibrationConfig(model="qwen3-8b-geometry", tokens=tokens, seq_len=seq_len, batch_size=batch_size,
                             heldout_tokens=512, dtype="bfloat16", device=DEV)


def time_shape(lm, seq_len: int, batch_size: int, repeats: int) -> tuple[dict, object]:
    """Plain forwards vs collect_statistics over the same 30K tokens, alternating; medians."""
    import torch

    from oscar_calib.calibration.collect import collect_statistics
    from oscar_calib.model.capture import capture_forward as _forward

    plan, cfg = gpu_plan(GPU_TOKENS, seq_len), gpu_cfg(GPU_TOKENS, seq_len, batch_size)
    batches = [b.to(DEV) for b in plan.batches(batch_size)]
    model = lm.model

    def plain():
        with torch.no_grad():
            for b in batches:
                _forward(model, b)
        _sync()

    run = None
    plain()
    collect_statistics(lm, plan, cfg)            # warm-up both paths
    times = {"plain": [], "capture": [], "statistics": [], "gather": [], "heldout": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        plain()
        times["plain"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        run, timing = collect_statistics(lm, plan, cfg)
        _sync()
        times["capture"].append(time.perf_counter() - t0)
        times["statistics"].append(timing["statistics_s"])
        times["heldout"].append(timing["heldout_s"])
        times["gather"].append(timing["gather_s"])
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"tokens": plan.tokens, "seq_len": seq_len, "batch_size": batch_size, "batches": len(batches),
            "plain_s": med["plain"], "capture_s": med["capture"], "statistics_s": med["statistics"],
            "heldout_s": med["heldout"], "gather_s": med["gather"], "tokens_per_s": plan.tokens / med["capture"],
            "plain_tokens_per_s": plan.tokens / med["plain"],
            "overhead": med["capture"] / med["plain"] - 1,
            "overhead_streaming": med["statistics"] / med["plain"] - 1, "times": times}, run


def peak_memory(lm, weights: int, seq_len: int, batch_size: int) -> list[dict]:
    import torch

    from oscar_calib.calibration.collect import collect_statistics
    from oscar_calib.model.capture import capture_forward as _forward

    rows = []
    for tokens in MEM_BUDGETS:
        plan, cfg = gpu_plan(tokens, seq_len), gpu_cfg(tokens, seq_len, batch_size)
        _reset_peak()
        base = _allocated()
        with torch.no_grad():
            for b in plan.batches(batch_size):
                _forward(lm.model, b.to(DEV))
        _sync()
        plain_peak = _peak() - base
        _reset_peak()
        t0 = time.perf_counter()
        collect_statistics(lm, plan, cfg)
        _sync()
        rows.append({"tokens": tokens, "seq_len": seq_len, "batch_size": batch_size, "weights_bytes": weights,
                     "peak_beyond_weights_bytes": _peak() - base,
                     "plain_forward_peak_beyond_weights_bytes": plain_peak, "capture_s": time.perf_counter() - t0})
    return rows


def update_microbench(lm, seq_len: int, batch_size: int, plain_per_batch_s: float) -> dict:
    """LayerStats.update alone on random bf16 activations of one batch, all layers: the default
    (half-precision-input grams, float32 sums per sequence, float64 running sums; no s_approx, as
    with --v-objective sst), the same with s_approx (sst-approx), OSCAR_EXACT_GRAMS=1 (every gram
    in float64), and the finiteness check."""
    import torch

    from oscar_calib.calibration.stats import ACCUMULATORS, LayerStats, check_finite

    geo = lm.geometry
    g = torch.Generator(device=DEV).manual_seed(0)
    b, t, hq, hk, d = batch_size, seq_len, geo.num_attention_heads, geo.num_kv_heads, geo.head_dim
    q = torch.randn(b, hq, t, d, device=DEV, generator=g).bfloat16()
    k = torch.randn(b, hk, t, d, device=DEV, generator=g).bfloat16()
    v = torch.randn(b, hk, t, d, device=DEV, generator=g).bfloat16()
    o = torch.randn(b, t, hq, d, device=DEV, generator=g).bfloat16()
    out = {"plain_forward_per_batch_s": plain_per_batch_s}
    firsts = {}
    for mode, exact, approx in (("half", False, False), ("half_with_s_approx", False, True), ("exact", True, False)):
        os.environ["OSCAR_EXACT_GRAMS"] = "1" if exact else "0"
        stats = [LayerStats(hk, geo.group, d, 1, device=torch.device(DEV), approx=approx)
                 for _ in range(geo.num_layers)]
        for s in stats:
            s.update(q, k, v, o)                # pilot frozen after the first batch: steady state from here
        firsts[mode] = {n: stats[0].sums[n].clone() for n in ACCUMULATORS}

        def one():
            for s in stats:
                s.update(q, k, v, o)
            _sync()

        one()
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            one()
            ts.append(time.perf_counter() - t0)
        out[f"update_{mode}_s"] = statistics.median(ts)
        out[f"update_{mode}_vs_forward"] = out[f"update_{mode}_s"] / plain_per_batch_s
        if mode == "half":
            check_finite(stats)
            _sync()
            t0 = time.perf_counter()
            for _ in range(5):
                check_finite(stats)
            out["finite_check_s"] = (time.perf_counter() - t0) / 5
    os.environ.pop("OSCAR_EXACT_GRAMS", None)
    out["half_vs_exact_max_rel_diff"] = max(float((firsts["half"][n] - firsts["exact"][n]).norm()
                                                  / firsts["exact"][n].norm()) for n in ("q", "s", "k", "v"))
    return out


def dp_worker(job: dict) -> None:
    """One rank of the data-parallel measurement (started by gpu_main through oscar's launcher)."""
    import torch

    from oscar_calib.calibration.collect import collect_statistics
    from oscar_calib.calibration.parallel import data_parallel
    from oscar_calib.calibration.stats import ACCUMULATORS
    from oscar_calib.model.capture import capture_forward as _forward

    global DEV, SMALL
    DEV, SMALL = job["device"], job["small"]
    if SMALL:
        _small(argparse.Namespace(gpu_device=DEV, small=True))
    with data_parallel(DEV) as ranks:
        ctx = ranks.ctx
        lm, _ = qwen3_8b_geometry(ctx.device)
        seq_len, batch_size = job["seq_len"], job["batch_size"]
        plan, cfg = gpu_plan(GPU_TOKENS, seq_len), gpu_cfg(GPU_TOKENS, seq_len, batch_size)
        mine = [b.to(ctx.device) for b in ranks.shard(plan.batches(batch_size))]

        def plain():
            with torch.no_grad():
                for b in mine:
                    _forward(lm.model, b)
            _sync()

        plain()
        collect_statistics(lm, plan, cfg, ranks=ranks)          # warm-up (NCCL, kernels)
        times = {"plain": [], "capture": [], "statistics": []}
        run = None
        for _ in range(job["repeats"]):
            for name in ("plain", "capture"):
                ctx.barrier("timing")
                t0 = time.perf_counter()
                if name == "plain":
                    plain()
                else:
                    run, timing = collect_statistics(lm, plan, cfg, ranks=ranks)
                    _sync()
                    times["statistics"].append(max(ctx.gather_objects(timing["statistics_s"], "timing")))
                dt = time.perf_counter() - t0
                times[name].append(max(ctx.gather_objects(dt, "timing")))   # the job's wall time: slowest rank
        if ctx.is_main:
            ref = torch.load(job["reference"], weights_only=True)
            worst = 0.0
            for got, want in zip(run.stats, ref):
                for n in ACCUMULATORS:
                    a, b = got.sums[n], want["sums"][n]
                    worst = max(worst, float((a - b).norm() / b.norm()))
            res = {"world_size": ctx.world_size, "device": torch.cuda.get_device_name(ctx.device) if _cuda() else "cpu",
                   "plain_s": statistics.median(times["plain"]), "capture_s": statistics.median(times["capture"]),
                   "statistics_s": statistics.median(times["statistics"]),
                   "times": times, "max_rel_diff_vs_single_gpu": worst}
            Path(job["result"]).write_text(json.dumps(res))


def gpu_main(args, argv=None) -> None:
    import tempfile

    import torch

    from oscar_calib.jobs.launch import launch

    _small(args)
    if _cuda() and not torch.cuda.is_available():
        sys.exit("--gpu needs CUDA (or --gpu-device cpu --small for a dry run)")
    dev_name = torch.cuda.get_device_name(0) if _cuda() else "cpu (dry run)"
    ngpu = torch.cuda.device_count() if _cuda() else 2
    if _cuda():
        torch.cuda.set_device(0)
    t0 = time.perf_counter()
    lm, weights = qwen3_8b_geometry("cuda:0" if _cuda() else "cpu")
    settings = {"gpu": True, "small": SMALL, "model": "random-init Qwen3-8B geometry, bf16, sdpa",
                "tokens": GPU_TOKENS, "text": "embedded corpus through a byte tokenizer", "shapes": SHAPES,
                "memory_budgets": MEM_BUDGETS, "repeats": args.repeats, "quick": SMALL}
    doc = new_result("calibrate", describe_device(cuda=_cuda()), script=__file__, argv=argv, settings=settings)
    doc.update(gpus=ngpu, weights_bytes=weights, build_s=time.perf_counter() - t0)
    print(f"{dev_name}: model built in {doc['build_s']:.1f} s, weights {weights / 2**30:.2f} GiB", flush=True)
    run0 = None
    for seq_len, bs in SHAPES:
        row, run = time_shape(lm, seq_len, bs, args.repeats)
        doc["rows"].append(row)
        run0 = run0 or run
        print(f"seq {seq_len} x {bs}: plain {row['plain_s']:.3f} s, capture {row['capture_s']:.3f} s "
              f"(overhead {row['overhead']:+.1%}, streaming only {row['overhead_streaming']:+.1%}; statistics "
              f"{row['statistics_s']:.3f} s, gather {row['gather_s']:.3f} s, held-out {row['heldout_s']:.3f} s)",
              flush=True)
    a = doc["rows"][0]
    doc["memory"] = peak_memory(lm, weights, a["seq_len"], a["batch_size"])
    doc["update_microbench"] = update_microbench(lm, a["seq_len"], a["batch_size"], a["plain_s"] / a["batches"])
    print(json.dumps(doc["update_microbench"]), flush=True)
    if ngpu >= 2 and not args.no_dp:
        del lm
        _reset_peak()
        with tempfile.TemporaryDirectory() as tmp:
            ref = Path(tmp) / "single.pt"
            torch.save([s.state_dict() for s in run0.stats], ref)
            job = {"seq_len": a["seq_len"], "batch_size": a["batch_size"], "repeats": args.repeats, "device": DEV,
                   "small": SMALL,
                   "reference": str(ref), "result": str(Path(tmp) / "dp.json")}
            t1 = time.perf_counter()
            launch(2, [sys.executable, __file__, "--dp-worker", json.dumps(job)])
            dp = json.loads(Path(job["result"]).read_text())
            dp["launch_total_s"] = time.perf_counter() - t1
        dp["speedup_vs_1gpu"] = a["capture_s"] / dp["capture_s"]
        dp["speedup_streaming_vs_1gpu"] = a["statistics_s"] / dp["statistics_s"]
        doc["data_parallel"] = dp
    print(f"wrote {write_result(doc, save=args.save, out=out_dir(args))}")
    gib = 2**30
    print(f"\n{dev_name}, random-init Qwen3-8B geometry (bf16, sdpa), weights {weights / gib:.2f} GiB")
    print(f"{'tokens':>7} {'seq x batch':>11} {'plain s':>8} {'capture s':>9} {'tok/s':>8} {'overhead':>9} "
          f"{'streaming':>9}")
    for r in doc["rows"]:
        print(f"{r['tokens']:>7} {r['seq_len']:>6} x {r['batch_size']:<2} {r['plain_s']:>8.3f} {r['capture_s']:>9.3f} "
              f"{r['tokens_per_s']:>8.0f} {r['overhead']:>8.1%} {r['overhead_streaming']:>9.1%}")
    for m in doc["memory"]:
        print(f"peak beyond weights at {m['tokens']:>6} tokens: {m['peak_beyond_weights_bytes'] / gib:.3f} GiB "
              f"(plain forward {m['plain_forward_peak_beyond_weights_bytes'] / gib:.3f} GiB)")
    if "data_parallel" in doc:
        dp = doc["data_parallel"]
        print(f"2 ranks (NCCL): capture {dp['capture_s']:.3f} s vs 1 GPU {a['capture_s']:.3f} s: speed-up "
              f"{dp['speedup_vs_1gpu']:.2f}x; streaming {dp['statistics_s']:.3f} s vs {a['statistics_s']:.3f} s: "
              f"{dp['speedup_streaming_vs_1gpu']:.2f}x (plain {dp['plain_s']:.3f} s vs {a['plain_s']:.3f} s); "
              f"accumulators vs 1 GPU: max rel diff {dp['max_rel_diff_vs_single_gpu']:.1e}")


if __name__ == "__main__":
    main()
