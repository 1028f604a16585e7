#!/usr/bin/env python
"""Calibration on several GPUs: the layouts a model can take, torchrun "nodes", data-parallel
scaling. Every scenario runs in its own process (a hang or a crash is recorded and the next one
runs), and the artifacts are compared byte for byte.

``layouts`` (a random-init Qwen3-32B-shaped model: 64 layers, hidden 5120, 64 query / 8 KV heads,
head_dim 128, intermediate 25600, vocab 151936; 32.8B parameters, 61 GiB in bf16):

* ``spread``: one process, the model spread over every visible GPU with an accelerate device map
  (what ``oscar calibrate --device-map auto`` does); its layers run one GPU after the other;
* ``ranks-x-spread``: ``--ranks`` data-parallel ranks, each spread over its own slice of the GPUs
  (``--nproc N --device-map auto``: oscar's ``placement_for_rank`` gives rank r GPUs ``r·k … r·k+k−1``);
  ``oscar verify`` then runs on rank 0's spread model;
* ``ranks``: ``--ranks`` ranks, each holding the whole model on its own GPU (needs ~62 GiB a GPU).

For each: a plain forward over the calibration batches (no capture; the baseline), the streaming
capture + accumulation (``collect_statistics``) and the whole ``calibrate`` (held-out rows,
rotations, clips, artifact; no verify), one warm-up ``calibrate`` then ``--repeats`` rounds
(medians), the peak memory of every GPU beyond what it held before (its weights), the artifact's
sha256 and the all-reduced float64 accumulators, compared with the first layout's.

``torchrun``: two ``torchrun --nnodes 2 --nproc-per-node K --rdzv-backend c10d`` launchers on this
host (each given its own GPUs, as two machines would be), running the real ``oscar calibrate`` on a
small random-init model saved to disk: (1) the artifact against one process's, byte for byte;
(2) one rank SIGKILLed mid-capture while the others are slowed (``tests/fault_worker.py``): how long
the survivors take to stop, and their one ``error:`` line each; (3) ``--resume`` to the same artifact.

``dp-scaling`` (a random-init Qwen3-8B-shaped model, one GPU per rank): 1, 2, 4 ranks, each a
separate job: capture throughput, the whole ``calibrate`` and its stages (``calibration.json``
timings), accumulators and artifact against one rank's.

Weights are random (normal, std 0.02; norms 1): speed and memory do not depend on their values.
Calibration text is the embedded corpus through a byte tokenizer. Checkpoints are off in the
timed runs (``checkpoint_every`` beyond the batch count), so rank counts compare compute alone.

    python scripts/bench/bench_scale.py                               # all scenarios, visible GPUs
    python scripts/bench/bench_scale.py --mode layouts --ranks 2
    python scripts/bench/bench_scale.py --mode dp-scaling --scale-ranks 1,2,4 --scale-tokens 32768
    python scripts/bench/bench_scale.py --small --device cpu          # dry run on the CPU (tiny, gloo)

Writes ``scale-{device}.json`` (``harness.py``'s format; the device slug counts the GPUs the
scenarios use, e.g. ``scale-h100x4.json``) into ``--out`` (default ``$OUT`` or ./bench_out) after
each scenario, with the logs of every scenario beside it, and prints a table last; ``--save`` also
installs it as the current result (a GPU run only: a dry run is refused).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # imported rather than run (the tests)
    sys.path.append(str(HERE))

from harness import (  # noqa: E402
    ROOT,
    add_output_args,
    describe_device,
    environment,
    new_result,
    out_dir,
    write_result,
)

TESTS = ROOT / "tests"

QWEN3_32B = dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                 num_attention_heads=64, num_key_value_heads=8, head_dim=128)
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128)
# the torchrun model is loaded from disk by every rank: small, with Qwen3's attention shapes
NODES = dict(vocab_size=512, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128)
SMALL = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, head_dim=32)
SHAPES = {"32b": QWEN3_32B, "8b": QWEN3_8B, "nodes": NODES, "small": SMALL}
LAYOUTS = ("spread", "ranks-x-spread", "ranks")
COMPARED = ("q", "s", "k", "v")          # the accumulators compared between runs (s_approx is off)
NCCL_SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

T0 = time.perf_counter()


def log(msg: str) -> None:
    """A progress line on stderr (prefixed with the rank inside a job)."""
    rank = os.environ.get("RANK")
    who = f"rank {rank} " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
    print(f"[{time.perf_counter() - T0:7.1f} s] {who}{msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- models and data

def build(geo: dict, where, device: str):
    """(LoadedModel, weight bytes per device) of a random-init bf16 Qwen3 model. ``where``: a device
    (``"cuda:1"``, ``"cpu"``) for the whole model, or a ``max_memory`` dict (GPU index -> bytes) to
    spread it over those GPUs with a balanced accelerate device map (what ``--device-map auto`` and
    oscar's per-rank ``max_memory`` give ``from_pretrained``)."""
    import torch
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory
    from bench_calibrate import ByteTokenizer
    from transformers import AutoModelForCausalLM, Qwen3Config

    from oscar_calib.model.load import LoadedModel
    from oscar_calib.model.source import ModelSource

    cfg = Qwen3Config(**geo, max_position_embeddings=40960, rope_theta=1_000_000, tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    spread = isinstance(where, dict)
    if spread and device == "cuda":
        split = model._no_split_modules
        budget = get_balanced_memory(model, max_memory=dict(where), no_split_module_classes=split,
                                     dtype=torch.bfloat16)
        dmap = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=split, dtype=torch.bfloat16)
        if any(not isinstance(v, int) for v in dmap.values()):
            raise RuntimeError(f"the model does not fit on GPUs {sorted(where)}: {sorted(set(dmap.values()), key=str)}")
    else:
        dmap = {"": "cpu" if spread else where}
    for name, dev in dmap.items():                  # materialise each part on its device, random weights there
        part = model.get_submodule(name) if name else model
        part.to_empty(device=f"cuda:{dev}" if isinstance(dev, int) else dev)
        init_weights(part, name)
    for name, m in list(model.named_modules()):     # non-persistent buffers (RoPE) are rebuilt where they live
        if hasattr(m, "inv_freq"):
            parent, _, child = name.rpartition(".")
            with torch.device(m.inv_freq.device):
                setattr(model.get_submodule(parent) if parent else model, child, type(m)(config=cfg))
    if spread and device == "cuda":
        model = dispatch_model(model, dmap)
    model.eval().requires_grad_(False)
    per_dev: dict[str, int] = {}
    for p in model.parameters():
        per_dev[str(p.device)] = per_dev.get(str(p.device), 0) + p.numel() * p.element_size()
    src = ModelSource(spec="random-init", model_id=f"random-init/Qwen3-{geo['num_hidden_layers']}L-shape",
                      path="", kind="local")
    return LoadedModel.wrap(model, ByteTokenizer(), src), per_dev


def init_weights(part, prefix: str = "") -> None:
    """Norms 1, every other weight normal (std 0.02) from a generator seeded by the parameter's full
    name on its own device: the same values whichever GPU (of one kind) or layout holds it, so every
    layout calibrates the same model."""
    import zlib

    import torch

    with torch.no_grad():
        for pname, p in part.named_parameters():
            full = f"{prefix}.{pname}" if prefix else pname
            if full.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                gen = torch.Generator(device=p.device)
                gen.manual_seed(zlib.crc32(full.encode()))
                p.normal_(0.0, 0.02, generator=gen)


def cfg_and_plan(s: dict):
    """The calibration settings and token plan of a scenario's settings ``s``."""
    from bench_calibrate import ByteTokenizer

    from oscar_calib.contract.config import CalibrationConfig
    from oscar_calib.data.corpus import plan_tokens

    heldout = min(s["heldout_tokens"], s["seq_len"])
    cfg = CalibrationConfig(model="random-init", tokens=s["tokens"], seq_len=s["seq_len"], batch_size=1,
                            heldout_tokens=heldout, dtype="bfloat16", device=s["device"],
                            checkpoint_every=10**6)
    plan = plan_tokens(ByteTokenizer(), data="embedded", tokens=s["tokens"], seq_len=s["seq_len"],
                       heldout_tokens=heldout, heldout_seqs=1, seed=0)
    return cfg, plan


# ----------------------------------------------------------------------------- timing

def sync(gpus: list[int]) -> None:
    """Wait for ``gpus`` (this process's; touching the others would open a context on each)."""
    import torch

    for i in gpus:
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


def measure(lm, cfg, plan, repeats: int, gpus: list[int], *, ranks=None, placement=None, keep: Path | None = None):
    """Medians of plain / capture / end to end (a warm-up ``calibrate`` first), the peak memory of
    ``gpus`` beyond what they held before each, and the last ``calibrate``'s result (its artifact
    copied into ``keep`` by rank 0)."""
    import shutil

    import torch

    from oscar_calib.calibration.collect import collect_statistics
    from oscar_calib.calibration.pipeline import calibrate
    from oscar_calib.model.capture import capture_forward
    from oscar_calib.model.placement import input_device

    dev = input_device(lm.model)
    shard = ranks.shard(plan.batches(cfg.batch_size)) if ranks is not None else plan.batches(cfg.batch_size)
    batches = [b.to(dev) for b in shard]
    last = {}

    def plain():                                # the capture's own forward (last-position logits), no hooks
        with torch.no_grad():
            for b in batches:
                capture_forward(lm.model, b)

    def capture():
        collect_statistics(lm, plan, cfg, ranks=ranks)

    def end_to_end():
        with tempfile.TemporaryDirectory() as tmp:
            res = calibrate(cfg, Path(tmp) / "out", loaded=lm, placement=placement)
            if res.artifact is not None and keep is not None:
                keep.mkdir(parents=True, exist_ok=True)
                for name in ("oscar.safetensors", "calibration.json"):
                    shutil.copyfile(res.out / name, keep / name)
            last["result"] = res

    runs = {"plain": plain, "capture": capture, "end_to_end": end_to_end}
    times = {k: [] for k in runs}
    mem = {}
    schedule = [("end_to_end", 0)] + [(name, rep) for rep in range(1, repeats + 1) for name in runs]
    for name, rep in schedule:
        if ranks is not None:
            ranks.barrier("timing")
        base = reset_peaks(gpus)
        t0 = time.perf_counter()
        runs[name]()
        sync(gpus)
        dt = time.perf_counter() - t0
        if ranks is not None:
            dt = max(ranks.ctx.gather_objects(dt, "timing"))          # the job's time: its slowest rank
        log(f"{'warm-up' if not rep else f'round {rep}'}: {name} {dt:.2f} s")
        if rep:
            times[name].append(dt)
            mem[name] = peaks(base)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"median_s": med, "times": times, "overhead_capture": med["capture"] / med["plain"] - 1,
            "tokens_per_s_capture": plan.tokens / med["capture"], "tokens_per_s_end_to_end": plan.tokens /
            med["end_to_end"], "peak_beyond_weights_bytes": mem}, last["result"]


def save_accumulators(stats: list, path: Path) -> None:
    """The all-reduced float64 sums and token counts of every layer (compared between runs)."""
    import torch

    torch.save({f"{i}.{n}": s.sums[n].cpu() for i, s in enumerate(stats) for n in COMPARED}
               | {f"{i}.tokens": torch.tensor(s.tokens) for i, s in enumerate(stats)}, path)


def verify_on(lm, artifact: Path, s: dict, gpus: list[int]) -> dict:
    """``oscar verify`` of ``artifact`` on the model in memory (spread or not), once, untimed rounds."""
    from oscar_calib.eval.verify import verify_artifact

    base = reset_peaks(gpus)
    t0 = time.perf_counter()
    res = verify_artifact(artifact, loaded=lm, device=s["device"],
                          backend="triton" if s["device"] == "cuda" else "torch",
                          depths=tuple(d for d in (512, 1024, 2048) if d < s["seq_len"]) or (s["seq_len"] // 2,),
                          write=False, plot=False, quiet=True)
    sync(gpus)
    return {"seconds": time.perf_counter() - t0, "passed": res.passed, "settings": res.settings,
            "summary": res.summary(), "peak_beyond_weights_bytes": peaks(base) if gpus else {}}


# ----------------------------------------------------------------------------- one job (layouts, dp-scaling)

def job_worker(job: dict) -> None:
    """One process of a layout's job: builds its model (its slice of the GPUs under data
    parallelism), measures, and (rank 0) writes the row, the artifact and the accumulators."""
    import contextlib

    import torch

    from oscar_calib.calibration.parallel import data_parallel
    from oscar_calib.jobs.env import launched
    from oscar_calib.model.placement import Placement

    s, layout = job["settings"], job["layout"]
    geo = SHAPES[job["shape"]]
    cuda = s["device"] == "cuda"
    placement = Placement("auto") if layout in ("spread", "ranks-x-spread") else None
    t0 = time.perf_counter()
    with (data_parallel(s["device"], placement) if launched() else contextlib.nullcontext()) as ranks:
        if ranks is None and placement is not None:                              # one process, every GPU
            gpus = list(range(torch.cuda.device_count())) if cuda else []
            where = {g: int(torch.cuda.mem_get_info(g)[0] * 0.9) for g in gpus} if cuda else {}
        elif placement is not None:                                              # this rank's slice
            mine = ranks.placement(placement)
            gpus = sorted(k for k in (mine.max_memory or {}) if isinstance(k, int)) if cuda else []
            where = {g: mine.max_memory[g] for g in gpus} if cuda else {}
        else:                                                                    # the whole model here
            where = (ranks.device if ranks is not None else "cuda:0") if cuda else "cpu"
            gpus = [torch.device(where).index] if cuda else []
        if cuda:
            torch.cuda.set_device(gpus[0])
        lm, weights = build(geo, where, s["device"])
        build_s = time.perf_counter() - t0
        log(f"{layout}: model built in {build_s:.1f} s on {sorted(weights)}")
        cfg, plan = cfg_and_plan(s)
        res, result = measure(lm, cfg, plan, s["repeats"], gpus, ranks=ranks, placement=placement,
                              keep=Path(job["keep"]))
        verify = None
        if job.get("verify") and (ranks is None or ranks.is_main):
            verify = verify_on(lm, Path(job["keep"]) / "oscar.safetensors", s, gpus)
            log(f"verify: {'PASS' if verify['passed'] else 'FAIL'} in {verify['seconds']:.1f} s")
        mine = {"gpus": gpus, "weights": weights, "peaks": res["peak_beyond_weights_bytes"], "build_s": build_s,
                "verify_peaks": verify["peak_beyond_weights_bytes"] if verify else {}}
        everyone = ranks.ctx.gather_objects(mine, "results") if ranks is not None else [mine]
        if ranks is None or ranks.is_main:
            save_accumulators(result.stats.stats, Path(job["accumulators"]))
            merged = {k: {} for k in res["peak_beyond_weights_bytes"]}
            for r in everyone:
                for k, v in r["peaks"].items():
                    merged[k].update(v)
            row = {**{k: v for k, v in res.items() if k != "peak_beyond_weights_bytes"},
                   "peak_beyond_weights_bytes": merged,
                   "weights_bytes": {k: v for r in everyone for k, v in r["weights"].items()},
                   "gpus_of_rank": [r["gpus"] for r in everyone], "build_s": max(r["build_s"] for r in everyone),
                   "calibrate_timings": result.report["timings"], "device_name": device_name(gpus)}
            if verify:
                row["verify"] = verify
            Path(job["result"]).write_text(json.dumps(row))
        if ranks is not None:
            ranks.barrier("the end of the job")


def device_name(gpus: list[int]) -> str:
    import torch

    return torch.cuda.get_device_name(gpus[0]) if gpus else platform.processor() or "cpu"


def run_job(layout: str, ranks: int, shape: str, s: dict, work: Path, *, verify: bool = False) -> dict:
    """A layout's job through oscar's launcher (``ranks`` processes; 1 is a plain process)."""
    from oscar_calib.jobs.launch import launch

    name = f"{shape}-{layout}-{ranks}"
    job = {"layout": layout, "shape": shape, "settings": s, "verify": verify, "keep": str(work / name),
           "result": str(work / f"{name}.json"), "accumulators": str(work / f"{name}.acc.pt")}
    (work / f"{name}.job.json").write_text(json.dumps(job))
    launch(ranks, [sys.executable, str(Path(__file__).resolve()), "--job", str(work / f"{name}.job.json")])
    row = json.loads(Path(job["result"]).read_text())
    artifact = Path(job["keep"]) / "oscar.safetensors"
    row.update(artifact=str(artifact), accumulators=job["accumulators"],
               artifact_sha256=hashlib.sha256(artifact.read_bytes()).hexdigest())
    return row


# ----------------------------------------------------------------------------- comparisons

def compare(row: dict, ref: dict) -> dict:
    """``row``'s artifact and accumulators against ``ref``'s: bit for bit, else the largest
    differences (float32 artifact tensors: absolute; float64 accumulators: relative to the tensor's
    largest entry)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    out = {"against": ref["name"], "artifact_bytes_equal": row["artifact_sha256"] == ref["artifact_sha256"]}
    if not out["artifact_bytes_equal"]:
        a, b = load_file(row["artifact"]), load_file(ref["artifact"])
        diffs = {k: float((a[k].double() - b[k].double()).abs().max()) for k in b if k in a and a[k].shape == b[k].shape}
        differing = {k: v for k, v in diffs.items() if v > 0}
        with safe_open(row["artifact"], "pt") as fa, safe_open(ref["artifact"], "pt") as fb:
            meta = sorted(k for k in fb.metadata() if fa.metadata().get(k) != fb.metadata()[k])
        out.update(tensors_differing=len(differing), tensors=len(b), max_abs_diff=max(diffs.values(), default=0.0),
                   worst=sorted(differing.items(), key=lambda kv: -kv[1])[:5], metadata_differing=meta,
                   keys_equal=set(a) == set(b))
    a, b = torch.load(row["accumulators"], weights_only=True), torch.load(ref["accumulators"], weights_only=True)
    equal = all(torch.equal(a[k], b[k]) for k in b)
    rel = max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-300)) for k in b if not k.endswith("tokens"))
    out.update(accumulators_bit_equal=equal, accumulators_max_rel_diff=rel,
               tokens_equal=all(torch.equal(a[k], b[k]) for k in b if k.endswith("tokens")))
    return out


# ----------------------------------------------------------------------------- scenarios

def layouts(args, s: dict, work: Path) -> list[dict]:
    rows = []
    per = max(args.gpus // args.ranks, 1)
    for layout in args.layouts.split(","):
        n = 1 if layout == "spread" else args.ranks
        row = {"scenario": "layouts", "name": f"{layout}", "layout": layout, "shape": args.shape, "ranks": n,
               "gpus_per_rank": args.gpus if layout == "spread" else per if layout == "ranks-x-spread" else 1,
               "tokens": s["tokens"], "seq_len": s["seq_len"], "heldout_tokens": s["heldout_tokens"]}
        try:
            row.update(run_job(layout, n, args.shape, s, work, verify=layout == args.verify))
        except BaseException as e:  # noqa: BLE001 - recorded; the next layout still runs
            row["error"] = f"{type(e).__name__}: {e}"
            log(f"{layout}: {row['error']}")
        rows.append(row)
        (work / "layouts.rows.json").write_text(json.dumps(rows))      # what is done survives a timeout
    add_comparisons(rows)
    return rows


def dp_scaling(args, s: dict, work: Path) -> list[dict]:
    rows = []
    for n in (int(x) for x in args.scale_ranks.split(",")):
        row = {"scenario": "dp-scaling", "name": f"{n} rank(s)", "layout": "ranks", "shape": args.scale_shape,
               "ranks": n, "gpus_per_rank": 1, "tokens": s["tokens"], "seq_len": s["seq_len"],
               "heldout_tokens": s["heldout_tokens"]}
        try:
            row.update(run_job("ranks", n, args.scale_shape, s, work))
        except BaseException as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"
            log(f"dp-scaling {n}: {row['error']}")
        rows.append(row)
        (work / "dp-scaling.rows.json").write_text(json.dumps(rows))
    add_comparisons(rows)
    base = next((r for r in rows if "median_s" in r), None)
    for r in rows:
        if base is not None and "median_s" in r:
            r["speedup"] = {k: base["median_s"][k] / r["median_s"][k] for k in r["median_s"]}
    return rows


def add_comparisons(rows: list[dict]) -> None:
    done = [r for r in rows if "artifact" in r]
    for r in done[1:]:
        try:
            r["equal_to_reference"] = compare(r, done[0])
        except Exception as e:  # noqa: BLE001
            r["equal_to_reference"] = {"error": f"{type(e).__name__}: {e}"}


def torchrun(args, s: dict, work: Path) -> list[dict]:
    """Two torchrun launchers on this host as two "nodes" (``torchrun_scenario``'s docstring)."""
    row = {"scenario": "torchrun", "name": f"2 nodes x {args.node_ranks}", "shape": "small" if args.small else "nodes",
           "nodes": 2, "ranks_per_node": args.node_ranks, "tokens": s["tokens"], "seq_len": s["seq_len"]}

    def save(part: dict) -> None:                  # after every stage: what is done survives a timeout
        row.update(part)
        (work / "torchrun.rows.json").write_text(json.dumps([row]))

    try:
        torchrun_scenario(args, s, work, save)
    except BaseException as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {e}"
        log(f"torchrun: {row['error']}")
    return [row]


def save_model_dir(geo: dict, path: Path) -> None:
    """A random-init bf16 Qwen3 checkpoint with a byte-level tokenizer (what every rank loads)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    sys.path.insert(0, str(TESTS))
    from factories import byte_tokenizer

    tok = byte_tokenizer()
    cfg = Qwen3Config(**{**geo, "vocab_size": max(geo["vocab_size"], len(tok))}, max_position_embeddings=40960,
                      rope_theta=1_000_000, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    init_weights(model)
    model.save_pretrained(path)
    tok.save_pretrained(path)


def torchrun_scenario(args, s: dict, work: Path, save) -> None:
    """The reference (one process), a clean 2 × K run, a run where the last rank is SIGKILLed after
    its ``die_at``-th batch while every other rank sleeps ``slow_s`` before each batch from then on,
    and ``--resume``; artifacts compared byte for byte, the survivors' stop times and lines. Each
    stage's results go to ``save`` as soon as it ends."""
    model = work / "nodes-model"
    save_model_dir(SHAPES["small" if args.small else "nodes"], model)
    k, world = args.node_ranks, 2 * args.node_ranks
    cuda = s["device"] == "cuda"
    common = ["--tokens", str(s["tokens"]), "--seq-len", str(s["seq_len"]), "--batch-size", "1",
              "--heldout-tokens", str(s["heldout_tokens"]), "--checkpoint-every", "1", "--device", s["device"],
              "--dtype", "bfloat16" if cuda else "float32", "--no-verify"]
    env = {**os.environ, **NCCL_SAFE, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)]),
           "OMP_NUM_THREADS": str(args.threads), "OSCAR_DIST_HEARTBEAT": str(args.heartbeat),
           "OSCAR_DIST_TIMEOUT": "300", "HF_HUB_OFFLINE": "1"}
    for key in [k_ for k_ in env if k_.startswith("OSCAR_TEST_")]:
        env.pop(key)
    out: dict = {"heartbeat_s": args.heartbeat, "threads_per_rank": args.threads}

    t0 = time.perf_counter()
    ref_env = dict(env, CUDA_VISIBLE_DEVICES="0") if cuda else env
    proc = subprocess.run([sys.executable, "-m", "oscar_calib", "calibrate", str(model), "--out", str(work / "ref"),
                           *common], env=ref_env, capture_output=True, text=True, timeout=600)
    (work / "torchrun-ref.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"the one-process reference failed: {tail(proc.stderr)}")
    ref = (work / "ref" / "oscar.safetensors").read_bytes()
    out["reference_s"] = time.perf_counter() - t0
    log(f"torchrun: one-process reference in {out['reference_s']:.1f} s")
    save(out)

    def nodes(name: str, dest: Path, *extra: str, faults: dict | None = None) -> list[dict]:
        """Both launchers; per node its exit code, when it exited (time.time()), its error lines."""
        port = free_port()
        procs = []
        for node in (0, 1):
            node_env = dict(env, **(faults or {}))
            if cuda:
                node_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(node * k + i) for i in range(k))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(k),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bench-{port}",
                   "--monitor-interval", "0.1", str(TESTS / "fault_worker.py"), "calibrate", str(model),
                   "--out", str(dest), *common, *extra]
            logf = open(work / f"torchrun-{name}-node{node}.log", "w")
            procs.append((subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=node_env), logf))
        ended: list = [None, None]
        deadline = time.time() + args.node_timeout
        while None in ended:
            for i, (p, _) in enumerate(procs):
                if ended[i] is None and p.poll() is not None:
                    ended[i] = time.time()
            if time.time() > deadline:                   # stop both launchers (they stop their ranks)
                for p, _ in procs:
                    if p.poll() is None:
                        p.terminate()
                for p, _ in procs:
                    try:
                        p.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
                ended = [e or time.time() for e in ended]
            time.sleep(0.05)
        res = []
        for node, (p, logf) in enumerate(procs):
            logf.close()
            text = (work / f"torchrun-{name}-node{node}.log").read_text()
            res.append({"exit_code": p.returncode, "ended": ended[node],
                        "errors": [ln for ln in text.splitlines() if ln.startswith("error:")],
                        "tracebacks_from_oscar": len(re.findall(r'File ".*oscar_calib', text)),
                        "log_tail": text[-2500:]})
        return res

    t0 = time.perf_counter()
    clean = nodes("clean", work / "clean")
    out["clean"] = {"nodes": clean, "wall_s": time.perf_counter() - t0}
    got = work / "clean" / "oscar.safetensors"
    out["clean"]["artifact_bytes_equal_one_process"] = got.exists() and got.read_bytes() == ref
    log(f"torchrun: clean 2 x {k}: {[n['exit_code'] for n in clean]}, equal {out['clean']['artifact_bytes_equal_one_process']}")
    save(out)

    mark, ends = work / "died", work / "ends"
    ends.mkdir()
    victim = world - 1
    faults = {"OSCAR_TEST_DIE_RANK": str(victim), "OSCAR_TEST_DIE_AT": str(args.die_at), "OSCAR_TEST_MARK": str(mark),
              "OSCAR_TEST_ENDS": str(ends),
              "OSCAR_TEST_SLOW": str(args.slow_s), "OSCAR_TEST_SLOW_FROM": str(args.die_at),
              "OSCAR_TEST_SLOW_RANKS": ",".join(str(r) for r in range(world) if r != victim)}
    dest = work / "fault"
    t_fault = time.time()
    fault = nodes("fault", dest, faults=faults)
    died = float(mark.read_text()) if mark.exists() else None
    for n in fault:
        n["exited_after_kill_s"] = None if died is None else n["ended"] - died
    rank_ends = {int(f.name.split("rank")[1]): float(f.read_text()) for f in ends.glob("end.rank*")}
    per_rank_lines = {}
    for n in fault:
        for line in n["errors"]:
            m = re.match(r"error: rank (\d+):", line)
            if m:
                per_rank_lines.setdefault(int(m.group(1)), []).append(line)
    ckpts = sorted(p.name for p in dest.glob(".oscar-checkpoint*.pt"))
    batches_per_rank = -(-s["tokens"] // s["seq_len"]) // world
    out["fault"] = {"nodes": fault, "victim_rank": victim, "die_after_batch": args.die_at, "slow_s": args.slow_s,
                    "batches_per_rank": batches_per_rank,
                    "survivors_would_need_s": (batches_per_rank - args.die_at + 1) * args.slow_s,
                    "died_after_start_s": None if died is None else died - t_fault,
                    "survivors_stopped_within_s": None if died is None or not rank_ends else
                    max(rank_ends.values()) - died,
                    "rank_stopped_after_kill_s": {r: None if died is None else t - died for r, t in sorted(rank_ends.items())},
                    "launchers_exited_after_kill_s": None if died is None else max(n["ended"] for n in fault) - died,
                    "error_lines_by_rank": per_rank_lines, "checkpoints_kept": ckpts,
                    "artifact_written": (dest / "oscar.safetensors").exists()}
    log(f"torchrun: fault run: exit codes {[n['exit_code'] for n in fault]}, stopped "
        f"{out['fault']['survivors_stopped_within_s']} s after the kill")
    save(out)

    t0 = time.perf_counter()
    resumed = nodes("resume", dest, "--resume")
    got = dest / "oscar.safetensors"
    out["resume"] = {"nodes": resumed, "wall_s": time.perf_counter() - t0,
                     "artifact_bytes_equal_one_process": got.exists() and got.read_bytes() == ref,
                     "checkpoints_left": sorted(p.name for p in dest.glob(".oscar-checkpoint*.pt"))}
    log(f"torchrun: resume: {[n['exit_code'] for n in resumed]}, equal {out['resume']['artifact_bytes_equal_one_process']}")
    save(out)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tail(text: str, n: int = 600) -> str:
    return text[-n:].replace("\n", " | ")


# ----------------------------------------------------------------------------- the driver

SCENARIOS = {"layouts": layouts, "torchrun": torchrun, "dp-scaling": dp_scaling}


def scenario_settings(args, name: str) -> dict:
    if name == "dp-scaling":
        return {"tokens": args.scale_tokens, "seq_len": args.seq_len, "heldout_tokens": args.heldout_tokens,
                "device": args.device, "repeats": args.repeats}
    if name == "torchrun":
        return {"tokens": args.node_tokens, "seq_len": args.node_seq_len, "heldout_tokens": 256,
                "device": args.device}
    return {"tokens": args.tokens, "seq_len": args.seq_len, "heldout_tokens": args.heldout_tokens,
            "device": args.device, "repeats": args.repeats}


def run_scenario(args, name: str, work: Path) -> list[dict]:
    """One scenario in its own process group, killed at ``args.scenario_timeout`` (rows saying so)."""
    result = work / f"{name}.rows.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--scenario", name, "--work", str(work), *args.argv]
    logf = open(work / f"{name}.log", "w")
    limit = max(min(scenario_timeout(args.scenario_timeout, name), args.deadline - (time.perf_counter() - T0)), 1)
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **NCCL_SAFE})
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        logf.close()
        why = f"did not finish within {limit:.0f} s (stopped); {tail((work / f'{name}.log').read_text())}"
        rows = json.loads(result.read_text()) if result.exists() else [{"scenario": name}]   # what it saved so far
        return [dict(r, error=why, partial=True) for r in rows]
    logf.close()
    if not result.exists():
        return [{"scenario": name, "error": f"exit code {proc.returncode}: {tail((work / f'{name}.log').read_text())}"}]
    return json.loads(result.read_text())


def scenario_timeout(spec: str, name: str) -> float:
    """``900`` (every scenario) or ``layouts=300,torchrun=150`` (900 for the others)."""
    if "=" not in spec:
        return float(spec)
    limits = dict(part.split("=", 1) for part in spec.split(",") if part)
    return float(limits.get(name, 900))


def stop_group(proc: subprocess.Popen) -> None:
    """Stop a scenario this driver started (its own process group): SIGTERM, which oscar's launcher
    and torchrun pass on to their ranks (each in a session of its own), then SIGKILL; then any
    process still holding a GPU, all of them started by this benchmark."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=45)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    try:
        q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return
    for pid in {int(x) for x in q.stdout.split() if x.strip().isdigit()} - {os.getpid()}:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            if Path(__file__).name in cmdline or "fault_worker.py" in cmdline:     # ours: a rank of a scenario
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def gpus_used(args, visible: int) -> int:
    """How many of the ``visible`` GPUs the chosen scenarios use (the device slug counts them): all
    of them for the spread layout, ranks × GPUs per rank for the others, the largest rank count
    for dp-scaling, both nodes' ranks for torchrun."""
    per = max(visible // args.ranks, 1)
    layouts = {"spread": visible, "ranks-x-spread": per * args.ranks, "ranks": args.ranks}
    need = {"layouts": max((layouts.get(x, 0) for x in args.layouts.split(",") if x), default=0),
            "dp-scaling": max((int(x) for x in args.scale_ranks.split(",") if x), default=0),
            "torchrun": 2 * args.node_ranks}
    return min(visible, max((need[m] for m in args.mode.split(",") if m), default=0))


def extra_versions() -> dict:
    """What this benchmark depends on beyond the harness's versions: accelerate (the device map)
    and NCCL (the all-reduces)."""
    out = {}
    try:
        out["accelerate"] = metadata.version("accelerate")
    except metadata.PackageNotFoundError:
        out["accelerate"] = None
    import torch

    if torch.cuda.is_available():
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def gpu_info() -> tuple[str, int]:
    """(name, count) of the visible GPUs without initialising CUDA in this process."""
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=60)
        names = [ln.strip() for ln in q.stdout.splitlines() if ln.strip()]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            names = [names[int(i)] for i in visible.split(",") if i.strip().isdigit() and int(i) < len(names)]
        return (names[0], len(names)) if names else ("cpu", 0)
    except (OSError, subprocess.SubprocessError):
        return "cpu", 0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="layouts,torchrun,dp-scaling",
                    help="comma-separated scenarios: layouts, torchrun, dp-scaling (default: all three)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny geometries everywhere (a dry run, e.g. on the CPU)")
    ap.add_argument("--shape", default="32b", choices=sorted(SHAPES), help="the layouts' model (default 32b)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="which layouts, in order (the first is the reference)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks of the ranks and ranks-x-spread layouts")
    ap.add_argument("--verify", default="ranks-x-spread", help="the layout whose model runs oscar verify ('' for none)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--heldout-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=1, help="timed rounds after the warm-up calibrate")
    ap.add_argument("--scale-shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--scale-ranks", default="1,2,4")
    ap.add_argument("--scale-tokens", type=int, default=32768)
    ap.add_argument("--node-ranks", type=int, default=2, help="ranks per torchrun 'node' (2 nodes)")
    ap.add_argument("--node-tokens", type=int, default=32768)
    ap.add_argument("--node-seq-len", type=int, default=1024)
    ap.add_argument("--heartbeat", type=float, default=5.0, help="OSCAR_DIST_HEARTBEAT of the torchrun runs")
    ap.add_argument("--die-at", type=int, default=3, help="the victim rank dies after this many of its batches")
    ap.add_argument("--slow-s", type=float, default=5.0, help="the others' sleep before each later batch")
    ap.add_argument("--threads", type=int, default=4, help="OMP_NUM_THREADS of every torchrun process")
    ap.add_argument("--deadline", type=float, default=3000.0, help="seconds for everything (later scenarios skip)")
    ap.add_argument("--scenario-timeout", default="900",
                    help="seconds for one scenario, or per scenario: layouts=300,torchrun=150,dp-scaling=150")
    ap.add_argument("--node-timeout", type=float, default=300.0, help="seconds for one torchrun run")
    add_output_args(ap)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--scenario", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)      # what the scenarios' processes get
    unknown = [m for m in args.mode.split(",") if m and m not in SCENARIOS]
    if unknown:
        raise SystemExit(f"error: --mode {','.join(unknown)}: use {', '.join(SCENARIOS)}")
    if args.save and (args.small or args.device == "cpu"):
        raise SystemExit("error: --save accepts a GPU run only; a dry run (--small, --device cpu) is never "
                         "a current result")
    if args.small:
        args.shape = args.scale_shape = "small"
    return args


def main(argv=None) -> None:
    """The NCCL safety switches and the ranks' timeout hold for this run and the processes it
    starts (the environment is restored afterwards: a test calls main() in its own process)."""
    with environment({**NCCL_SAFE, "OSCAR_DIST_TIMEOUT": "300"}):
        return _main(argv)


def _main(argv=None) -> None:
    args = parse_args(argv)
    if args.job:
        return job_worker(json.loads(Path(args.job).read_text()))
    count = gpu_info()[1] if args.device == "cuda" else 0
    args.gpus = count if args.device == "cuda" else 2
    if args.scenario:
        rows = SCENARIOS[args.scenario](args, scenario_settings(args, args.scenario), Path(args.work))
        (Path(args.work) / f"{args.scenario}.rows.json").write_text(json.dumps(rows))
        return
    if args.device == "cuda" and count < 2:
        sys.exit("error: bench_scale needs 2 or more GPUs (or --small --device cpu for a dry run)")
    out = out_dir(args)
    device = describe_device(cuda=True, count=gpus_used(args, count)) if args.device == "cuda" else \
        describe_device(cuda=False)
    settings = {k: v for k, v in vars(args).items() if k not in ("job", "scenario", "work", "out", "save", "argv")}
    doc = new_result("scale", device, script=__file__, argv=args.argv,
                     settings={**settings, "quick": args.small or args.device == "cpu"})
    doc["versions"].update(extra_versions())
    slug = doc["device"]
    work = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    for scen in [m for m in args.mode.split(",") if m]:
        if time.perf_counter() - T0 > args.deadline - 30:
            doc["rows"].append({"scenario": scen, "error": "not run: out of time (--deadline)"})
            continue
        log(f"scenario {scen}")
        doc["rows"] += run_scenario(args, scen, work)
        write_result(doc, save=False, out=out)                      # after each scenario
        for logname in (f"{scen}.log",):
            if (work / logname).exists():
                (out / f"scale-{slug}-{logname}").write_text((work / logname).read_text()[-2_000_000:])
    path = write_result(doc, save=args.save, out=out)
    print_tables(doc)
    print(f"\n{'current result' if args.save else 'wrote'}: {path}")


def gib(b) -> str:
    return f"{b / 2**30:.2f}"


def print_tables(doc: dict) -> None:
    print(f"\n{doc['device_name']} ({doc['device']}), commit {doc['commit']}, {doc['date']}")
    for r in doc["rows"]:
        if "error" in r:
            print(f"{r['scenario']:>10} {r.get('name', '')}: ERROR {r['error'][:300]}")
            continue
        if r["scenario"] in ("layouts", "dp-scaling"):
            m = r["median_s"]
            pk = ", ".join(f"{k[5:]}:{gib(v)}" for k, v in sorted(r["peak_beyond_weights_bytes"]["end_to_end"].items()))
            eq = r.get("equal_to_reference")
            eqs = ("ref" if eq is None else "bytes=" if eq.get("artifact_bytes_equal") else
                   f"diff {eq.get('tensors_differing')}/{eq.get('tensors')} max {eq.get('max_abs_diff', 0):.1e}")
            if eq is not None and "accumulators_bit_equal" in eq:
                rel = eq["accumulators_max_rel_diff"]
                eqs += ", acc bit-equal" if eq["accumulators_bit_equal"] else f", acc rel {rel:.1e}"
            t = r["calibrate_timings"]
            print(f"{r['scenario']:>10} {r['name']:>15} {r['ranks']}x{r['gpus_per_rank']}: plain {m['plain']:.2f} "
                  f"capture {m['capture']:.2f} ({r['tokens_per_s_capture']:.0f} tok/s) calibrate {m['end_to_end']:.2f} "
                  f"(fits {t.get('rotations_and_clips_s', 0):.2f}) peak+ {pk} GiB; {eqs}")
            if "verify" in r:
                v = r["verify"]
                print(f"{'':>10} verify: {'PASS' if v['passed'] else 'FAIL'} in {v['seconds']:.1f} s "
                      f"(attention error {v['summary']['mean_attn_error']:.4f} vs Hadamard "
                      f"{v['summary']['mean_attn_error_hadamard']:.4f})")
        else:
            f = r["fault"]
            within = f["survivors_stopped_within_s"]
            print(f"{'torchrun':>10} {r['name']}: clean equal={r['clean']['artifact_bytes_equal_one_process']}; "
                  f"kill rank {f['victim_rank']}: exits {[n['exit_code'] for n in f['nodes']]}, stopped "
                  f"{'?' if within is None else f'{within:.1f}'} s after (would need {f['survivors_would_need_s']:.0f} s), "
                  f"lines {sorted(f['error_lines_by_rank'])}; resume equal={r['resume']['artifact_bytes_equal_one_process']}")
            for rank, lines in sorted(f["error_lines_by_rank"].items()):
                print(f"{'':>10}   {lines[0][:200]}")


if __name__ == "__main__":
    main()
