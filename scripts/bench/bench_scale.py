#!/usr/bin/env python
"""Calibrating a model too big for one GPU: a random-init Qwen3-32B-shaped model (64 layers, hidden
5120, 64 query / 8 KV heads, head_dim 128, intermediate 25600, vocab 151936; 32.8B parameters,
65.5 GB in bf16) on two GPUs, two ways, in one run:

* ``spread``: one process, the model spread over every visible GPU with accelerate's device map
  (what ``oscar calibrate --device-map auto`` does), layers run one GPU after the other;
* ``dp``: two data-parallel ranks (oscar's launcher, NCCL), each holding the whole model on its own
  GPU (needs ~66 GB + activations per GPU: H200s, or H100s at short sequences).

For each: a plain forward over the calibration batches (no capture; the baseline), the streaming
capture + accumulation (``collect_statistics``), and the whole ``calibrate`` (held-out capture,
rotations, clips, artifact; no verify), timed alternately (medians of ``--repeats``), and the peak
memory of every GPU beyond its weights. The overhead is capture / plain − 1, in the same run. The
spread model is then verified once (``oscar verify`` on a fresh artifact, INT2 kernels on the GPUs).
Weights are random (normal, std 0.02; norms 1): speed and memory do not depend on their values.
Calibration text is the embedded corpus through a byte tokenizer.

    python scripts/bench/bench_scale.py                           # both, on the visible GPUs (2 expected)
    python scripts/bench/bench_scale.py --mode spread --tokens 32768 --seq-len 4096
    python scripts/bench/bench_scale.py --small --device cpu      # dry run on the CPU (tiny geometry, gloo)

Writes ``scale-DEVICE.json`` (``harness.py``'s format) to ``--out`` (default ``$OUT`` or ./bench_out)
after each mode, with ``--save`` also as the current result, and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

QWEN3_32B = dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                 num_attention_heads=64, num_key_value_heads=8, head_dim=128)
SMALL = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, head_dim=32)


T0 = time.perf_counter()


def log(msg: str) -> None:
    """A progress line on stderr (the runs take minutes on a 32B model)."""
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def build(geo: dict, placement: str | dict):
    """(LoadedModel, weight bytes per device) of a random-init bf16 Qwen3 model: ``placement`` is a
    device (``"cuda:1"``, ``"cpu"``) or ``"spread"`` (accelerate device map over the visible GPUs)."""
    import torch
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory
    from bench_calibrate import ByteTokenizer
    from transformers import AutoModelForCausalLM, Qwen3Config

    from oscar_calib.model.load import LoadedModel, ModelSource

    cfg = Qwen3Config(**geo, max_position_embeddings=40960, rope_theta=1_000_000, tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    if placement == "spread":
        split = model._no_split_modules
        if torch.cuda.is_available():               # balanced over the GPUs, as --device-map balanced
            budget = get_balanced_memory(model, no_split_module_classes=split, dtype=torch.bfloat16)
        else:
            budget = {"cpu": 2**40}
        dmap = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=split, dtype=torch.bfloat16)
    else:
        dmap = {"": placement}
    torch.manual_seed(0)
    for name, dev in dmap.items():                  # materialise each part on its device, random weights there
        part = model.get_submodule(name) if name else model
        part.to_empty(device=dev if not isinstance(dev, int) else f"cuda:{dev}")
        with torch.no_grad():
            for pname, p in part.named_parameters():
                p.fill_(1.0) if pname.endswith("norm.weight") else p.normal_(0.0, 0.02)
    for name, m in list(model.named_modules()):     # non-persistent buffers (RoPE) are rebuilt where they live
        if hasattr(m, "inv_freq"):
            parent, _, child = name.rpartition(".")
            with torch.device(m.inv_freq.device):
                setattr(model.get_submodule(parent) if parent else model, child, type(m)(config=cfg))
    if placement == "spread":
        model = dispatch_model(model, dmap)
    model.eval().requires_grad_(False)
    per_dev: dict[str, int] = {}
    for p in model.parameters():
        per_dev[str(p.device)] = per_dev.get(str(p.device), 0) + p.numel() * p.element_size()
    src = ModelSource(spec="qwen3-32b-shape", model_id="random-init/Qwen3-32B-shape", path="", kind="local")
    return LoadedModel.wrap(model, ByteTokenizer(), src), per_dev


def cfg_and_plan(args, device: str):
    from bench_calibrate import ByteTokenizer

    from oscar_calib.calibrate.corpus import plan_tokens
    from oscar_calib.spec.config import CalibrationConfig

    cfg = CalibrationConfig(model="qwen3-32b-shape", tokens=args.tokens, seq_len=args.seq_len, batch_size=1,
                            heldout_tokens=min(512, args.seq_len), dtype="bfloat16", device=device)
    plan = plan_tokens(ByteTokenizer(), data="embedded", tokens=args.tokens, seq_len=args.seq_len,
                       heldout_tokens=min(512, args.seq_len), heldout_seqs=1, seed=0)
    return cfg, plan


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def reset_peaks(gpus: list[int]) -> dict[int, int]:
    import torch

    base = {}
    for i in gpus:
        torch.cuda.reset_peak_memory_stats(i)
        base[i] = torch.cuda.memory_allocated(i)
    return base


def peaks(base: dict[int, int]) -> dict[str, int]:
    import torch

    return {f"cuda:{i}": torch.cuda.max_memory_allocated(i) - b for i, b in base.items()}


def measure(lm, cfg, plan, repeats: int, gpus: list[int], ranks=None, shard=None) -> dict:
    """Medians of plain / capture / end to end, alternating, and peak memory of ``gpus`` beyond the weights."""
    import torch

    from oscar_calib.calibrate.pipeline import calibrate, collect_statistics
    from oscar_calib.model.capture import capture_forward
    from oscar_calib.model.placement import input_device

    dev = input_device(lm.model)
    batches = [b.to(dev) for b in (shard or plan.batches(cfg.batch_size))]

    def plain():                                # the capture's own forward (last-position logits), no hooks
        with torch.no_grad():
            for b in batches:
                capture_forward(lm.model, b)

    def capture():
        collect_statistics(lm, plan, cfg, ranks=ranks)

    def end_to_end():
        with tempfile.TemporaryDirectory() as tmp:
            calibrate(cfg, Path(tmp) / "out", loaded=lm)

    runs = {"plain": plain, "capture": capture, "end_to_end": end_to_end}
    times = {k: [] for k in runs}
    mem = {}
    for rep in range(repeats + 1):                 # the first round warms up
        for name, fn in runs.items():
            if ranks is not None:
                ranks.barrier("timing")
            base = reset_peaks(gpus)
            t0 = time.perf_counter()
            fn()
            sync()
            dt = time.perf_counter() - t0
            if ranks is not None:
                dt = max(ranks.ctx.gather_objects(dt, "timing"))          # the job's time: its slowest rank
            log(f"{'warm-up' if not rep else f'round {rep}'}: {name} {dt:.2f} s")
            if rep:
                times[name].append(dt)
                mem[name] = peaks(base)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"tokens": plan.tokens, "seq_len": cfg.seq_len, "median_s": med, "times": times,
            "overhead_capture": med["capture"] / med["plain"] - 1,
            "overhead_end_to_end": med["end_to_end"] / med["plain"] - 1,
            "tokens_per_s_capture": plan.tokens / med["capture"], "peak_beyond_weights_bytes": mem}


def spread_main(args, geo) -> dict:
    t0 = time.perf_counter()
    lm, weights = build(geo, "spread")
    log(f"spread: model built in {time.perf_counter() - t0:.1f} s, weights per device "
        + ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in sorted(weights.items())))
    cfg, plan = cfg_and_plan(args, "cuda" if args.device == "cuda" else "cpu")
    import torch

    gpus = list(range(torch.cuda.device_count())) if args.device == "cuda" else []
    build_s = time.perf_counter() - t0
    res = measure(lm, cfg, plan, args.repeats, gpus)
    return {"mode": "spread", "build_s": build_s, "weights_bytes": weights,
            "device_map": sorted({str(v) for v in getattr(lm.model, "hf_device_map", {}).values()}), **res,
            "verify": verify_spread(lm, cfg, gpus, args)}


def verify_spread(lm, cfg, gpus: list[int], args) -> dict:
    """``oscar verify`` of a fresh artifact on the spread model (once, not in the timed rounds): its
    captures stay on the CPU and each layer is checked on the device its inputs go to, with the
    INT2 kernels where the device is a GPU."""
    from oscar_calib.calibrate.pipeline import calibrate
    from oscar_calib.tools.verify import verify_artifact

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        calibrate(cfg, out, loaded=lm)
        log("verify: artifact written")
        base = reset_peaks(gpus)
        t0 = time.perf_counter()
        res = verify_artifact(out / "oscar.safetensors", loaded=lm, device=args.device,
                              backend="triton" if args.device == "cuda" else "torch",
                              depths=tuple(d for d in (512, 1024, 2048) if d < args.seq_len) or (args.seq_len // 2,),
                              write=False, plot=False, quiet=True)
        sync()
        return {"seconds": time.perf_counter() - t0, "passed": res.passed, "settings": res.settings,
                "summary": res.summary(), "peak_beyond_weights_bytes": peaks(base) if gpus else {}}


def dp_worker(job: dict) -> None:
    """One data-parallel rank (started by dp_main through oscar's launcher)."""
    import torch

    from oscar_calib.calibrate.parallel import data_parallel

    args = argparse.Namespace(**job["args"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = f"cuda:{local}" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(dev)
    t0 = time.perf_counter()
    lm, weights = build(job["geo"], dev)
    log(f"dp rank on {dev}: model built in {time.perf_counter() - t0:.1f} s")
    cfg, plan = cfg_and_plan(args, args.device)
    with data_parallel(args.device) as ranks:
        build_s = time.perf_counter() - t0
        log(f"dp rank {ranks.rank} of {ranks.world_size} joined")
        res = measure(lm, cfg, plan, args.repeats, [local] if args.device == "cuda" else [], ranks=ranks,
                      shard=ranks.shard(plan.batches(cfg.batch_size)))
        everyone = ranks.ctx.gather_objects({"weights": weights, "peaks": res["peak_beyond_weights_bytes"],
                                             "build_s": build_s}, "results")
        if ranks.is_main:
            res.update(mode="dp", world_size=ranks.world_size, per_rank=everyone)
            Path(job["result"]).write_text(json.dumps(res))


def dp_main(args, geo) -> dict:
    from oscar_calib.calibrate.launch import launch

    with tempfile.TemporaryDirectory() as tmp:
        job = {"args": vars(args), "geo": geo, "result": str(Path(tmp) / "dp.json")}
        launch(2, [sys.executable, __file__, "--dp-worker", json.dumps(job)])
        return json.loads(Path(job["result"]).read_text())


def main(argv=None) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))          # bench_calibrate's ByteTokenizer, harness
    from harness import (
        add_output_args,
        describe_device,
        new_result,
        out_dir,
        write_result,
    )
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("both", "spread", "dp"), default="both")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--small", action="store_true", help="a tiny geometry (a dry run, e.g. on the CPU)")
    ap.add_argument("--dp-worker", help=argparse.SUPPRESS)
    add_output_args(ap)
    args = ap.parse_args(argv)
    if args.dp_worker:
        return dp_worker(json.loads(args.dp_worker))
    import torch

    if args.device == "cuda" and torch.cuda.device_count() < 2:
        sys.exit("bench_scale needs 2 GPUs (or --small --device cpu for a dry run)")
    geo = SMALL if args.small else QWEN3_32B
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    settings = {"mode": args.mode, "tokens": args.tokens, "seq_len": args.seq_len, "repeats": args.repeats,
                "small": args.small, "geometry": geo, "quick": args.device == "cpu"}
    doc = new_result("scale", describe_device(cuda=args.device == "cuda", count=max(1, gpus)), script=__file__,
                     argv=argv, settings=settings)
    doc["gpus"] = gpus
    for mode, run in (("spread", spread_main), ("dp", dp_main)):
        if args.mode in ("both", mode):
            doc["rows"].append(run(args, geo))
            write_result(doc, save=False, out=out_dir(args))     # after each mode
    if args.save:
        print(f"current result: {write_result(doc, save=True, out=out_dir(args))}")
    gib = 2**30
    print(f"\n{doc['device_name']} x{doc['gpus']}, random-init {'tiny' if args.small else 'Qwen3-32B'}-shaped model, "
          f"bf16, {args.tokens} tokens in sequences of {args.seq_len}")
    print(f"{'mode':>7} {'plain s':>8} {'capture s':>9} {'end-to-end s':>12} {'overhead':>9} {'e2e ovh':>8} "
          f"{'tok/s':>8}  peak beyond weights (GiB, capture)")
    for r in doc["rows"]:
        m = r["median_s"]
        pk = ", ".join(f"{k} {v / gib:.2f}" for k, v in r["peak_beyond_weights_bytes"]["capture"].items()) or "–"
        print(f"{r['mode']:>7} {m['plain']:>8.3f} {m['capture']:>9.3f} {m['end_to_end']:>12.3f} "
              f"{r['overhead_capture']:>8.1%} {r['overhead_end_to_end']:>8.1%} {r['tokens_per_s_capture']:>8.0f}  {pk}")
        if "verify" in r:
            v = r["verify"]
            pv = ", ".join(f"{k} {b / gib:.2f}" for k, b in v["peak_beyond_weights_bytes"].items()) or "–"
            print(f"{'':>7} verify on the spread model: {v['seconds']:.1f} s, "
                  f"{'PASS' if v['passed'] else 'FAIL'} (attention error {v['summary']['mean_attn_error']:.4f} "
                  f"against Hadamard's {v['summary']['mean_attn_error_hadamard']:.4f}); peak beyond weights {pv}")


if __name__ == "__main__":
    main()
