#!/usr/bin/env python
"""Render ``docs/benchmarks.md`` from the current results in ``scripts/bench/results/``.

    python scripts/bench/report.py            # rewrite docs/benchmarks.md and its figures
    python scripts/bench/report.py --check    # exit 1 if the page or a figure differs from a fresh rendering

One section per benchmark: what it measures and against what, then one table per device, each
with the device, commit, date, command and the JSON it came from. Every speed ratio names its
baseline; figures shown for reference only carry no ratio. The plots beside the tables (decode
time and % of copy bandwidth against context, a decode step's time by category) are SVG files
in ``docs/img/bench/``, drawn from the same results by ``plots.py``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # imported rather than run (the tests)
    sys.path.append(str(Path(__file__).resolve().parent))

import plots  # noqa: E402
from harness import BENCHMARKS, RESULTS, ROOT, load_results  # noqa: E402

PAGE = ROOT / "docs" / "benchmarks.md"
FIGURES = PAGE.parent / "img" / "bench"  # owned by this script: every .svg there is one of its figures
FIGURE_ALT = {"time": "Decode time against context", "bandwidth": "Decode bytes per second as % of copy bandwidth",
              "step": "A decode step's kernel time by category"}

INTRO = """# Benchmarks

Every benchmark is a script under `scripts/bench/` that checks what it times, writes one JSON
result and prints a table. Run one with `python scripts/bench/run.py NAME [ARGS]` (or
`make bench B=NAME ARGS=...`); NAME is one of {names}. Each script also runs directly
(`python scripts/bench/bench_NAME.py --help`) and has a `--quick` (or dry-run) mode that checks it
on a CPU in seconds.

A run writes `NAME-DEVICE.json` to `--out` (default `$OUT` or `./bench_out`). An accepted run is
the **current result** for its benchmark and device, `scripts/bench/results/NAME-DEVICE.json`:
`--save` installs it where it ran, `python scripts/bench/run.py accept FILE` installs one fetched
from a GPU machine. It replaces the file before it (the history is in git). A run of some
sections keeps the other sections of the current file, each recorded under `carried` with the
commit, date and command that measured it. Every result carries `device`, `commit`, `date`,
`command` and the library `versions`; on a machine with a copy of the tree, set
`OSCAR_BENCH_COMMIT` to the commit it holds (it wins over that copy's `.git`, which may lag). The timing rules (`scripts/bench/harness.py`): CUDA
events or `triton.testing.do_bench` medians after a warm-up, CUDA-graph replays where host launch
overhead is not what is measured, inputs random and rotated through copies larger than L2, every
ratio against a baseline measured in the same run.

This page is generated from those files by `python scripts/bench/report.py`; a test checks that
it matches them. Research runs (ablations, sweeps, diagnostics) live in `scripts/experiments/`.
"""

ABOUT = {
    "kernels": """The INT2 decode-attention kernel and the write kernel, on random tensors of Qwen3-8B's
attention shapes (32 query / 8 KV heads, head_dim 128, group 128, 64 sink + 256 recent BF16
tokens). **Baseline: `torch.nn.functional.scaled_dot_product_attention` on a BF16 cache of the same
context** (flash attention; the faster of `enable_gqa` and the GQA group folded into query rows),
timed the same way in the same run. Both are CUDA-graph replays with L2 flushed before each call
(`do_bench`'s write flush unless the settings say `read`). "% of copy" is the bytes each must read
per second over the device's measured copy bandwidth (bytes read + written), so a pure read can
pass 100%: SDPA at batch 32 does, and the INT2 kernel's speed-up there is close to the ratio of
bytes. Each timed call alone includes a floor of about 4.5 µs (the replay of a graph of one trivial
kernel: the breakdown's `floor`), a large share of a batch-1 call; the **in stream** columns time
the same calls back to back in one CUDA graph over their rotating input copies (each call reads
what the calls before it evicted from L2), as the layers of a decode step run them, for INT2 and
SDPA alike. **Second baseline: FlashInfer's BF16 decode** (`BatchDecodeWithPagedKVCacheWrapper`
on a paged cache of 16-token pages, planned outside the timed replays; the faster of its CUDA-core
decode kernel, which vLLM runs for a GQA group of 4, and its tensor-core form), checked against
SDPA and timed the same way in the same run where it imports on the GPU machine; otherwise the
page says why in one line. The runtime's
decode step gets its query already
rotated from the cache write; its call is the batch-1 breakdown's `call` less what the rotation
kernel adds.""",
    "append": """One decode step's cache write, `kernels.append_token`, 36 calls per CUDA graph (one per
layer, each into its own layer's buffers, L2 warm), Qwen3-8B KV shapes; and the step's attention
per layer (write + decode kernel over a filled cache), the query rotated by the decode call or
inside `append_token`. **Baseline for the step: a BF16 cache written at a device position
(`index_copy_`) then SDPA over the same context**, as a static BF16 cache runs it, same layers
and no L2 flush. The torch column of the write table is the pure-torch reference of the write
(the ops a decode step ran before `append_token`), shown for scale, not as a baseline.""",
    "generate": """The whole model: a random-init Qwen3-8B-shaped model (36 layers, bf16) decoding after a
context filled with random K/V through each cache's own write path. `OscarCache` is the INT2
cache with the Triton kernels. **Baseline: BF16 at its best at decode** (`bench_generate_fair.py`):
a static BF16 cache whose attention reads only the tokens it holds, unmasked, one query row per
head with the GQA group inside flash attention, recorded in a CUDA graph and, in the compiled
rows, with the decoder layers through `torch.compile` exactly as `DecodeGraph(compile=True)`
compiles them; the fastest of SDPA over the exact prefix (one graph per length, replayed),
flash attention's variable-length form (one graph for a growing history, timed as a greedy loop
like `DecodeGraph`'s) and, where it runs, FlashInfer's paged decode as serving engines call it
(replayed like SDPA). The roofline of a step is the bytes it must read (weights, the embedding
table at the batch's rows only, the KV cache as stored) over the copy bandwidth measured in the
same run. The transformers rows below it (`DynamicCache` + SDPA eager, `StaticCache` + SDPA in a
CUDA graph) are **transformers' stock path**, shown for reference only: they read the cache
through a mask or re-expand it at every step, so this page gives no speed-up against them.""",
    "calibrate": """Calibration cost: capture + accumulation against a plain forward pass over the same batches
(the overhead), and peak memory at two token budgets; on a CPU with SmolLM2-135M, or with
`--gpu` on a random-init Qwen3-8B-geometry model.""",
    "scale": """Calibration on several GPUs of one host, three scenarios, each in its own process. **layouts**:
a random-init Qwen3-32B-shaped model (61 GiB in bf16) spread over every GPU in one process
(`--device-map auto`), as ranks each spread over its own GPUs (`--nproc N --device-map auto`),
and as ranks holding the whole model each. **Baseline: a plain forward pass over the same
calibration batches** on the same placement; the capture's overhead is capture / plain − 1.
**torchrun**: two `torchrun --nnodes 2` launchers on one host as two nodes, each rank running
`oscar calibrate`: the artifact against one process's, one rank killed mid-capture (how soon the
others stop, and what they print), `--resume` to the same artifact. **dp-scaling**: a
random-init Qwen3-8B-shaped model on 1, 2, 4 ranks of one GPU each; **baseline: one rank**.
Artifacts (byte for byte) and the float64 accumulators (bit for bit) are compared with the first
layout's or rank count's. Weights are random (speed and memory do not depend on their values).""",
    "first_run": """A new user's first hour on the project's shared 2-core CPU machine: start-up of the light
commands, `make demo`'s command, `calibrate --quick` and the accuracy of their artifacts, the
default `oscar eval`, and the README's Python snippet (the 2-bit cache on the CPU's path).
**Baseline: another checkout** (main before the change measured), run alternately with this one
in the same session; every row records the load average before it, so compare rows of one run.""",
}


# ------------------------------------------------------------------------------------------ format
def _f(x, spec=".1f", none="–") -> str:
    return none if x is None else format(x, spec)


def _ctx(t: int) -> str:
    return f"{t // 1024}K" if t >= 1024 and t % 1024 == 0 else str(t)


def _table(head: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(map(str, r)) + " |"
                                                                          for r in rows]


def _source(doc: dict) -> list[str]:
    """Where a table comes from: device, commit, date, the JSON, versions; the command(s); a note."""
    v = doc.get("versions", {})
    vs = ", ".join(f"{k} {v[k]}" for k in ("torch", "triton", "transformers", "cuda") if v.get(k))
    head = (f"*{doc['device_name']}* · commit `{_commit(doc['commit'])}` · {doc['date'][:10]} · "
            f"`{doc['path']}`" + (f" · {vs}" if vs else ""))
    text = f"Command: `{doc['command']}`."
    carried = sorted(doc.get("carried", {}).items())
    if carried:
        text += " Sections from earlier runs: " + "; ".join(
            f"`{key}` from commit `{c['commit']}` ({c['date'][:10]}), `{c['command']}`" for key, c in carried) + "."
    if doc.get("provenance"):
        text += f" Note: {doc['provenance']}."
    return [head, "", text, ""]


# ------------------------------------------------------------------------------------------ tables
def kernels(doc: dict) -> list[str]:
    bw = doc["copy"]["bytes_per_s"]
    out = [f"Copy bandwidth {bw / 1e12:.2f} TB/s (read + write).", ""]
    rows = []
    stream = any("int2_stream_ms" in r for r in doc["rows"])
    fi = any("flashinfer_ms" in r for r in doc["rows"])
    for r in doc["rows"]:
        if "int2_ms" not in r:
            continue
        row = [_ctx(r["context"]), r["batch"], _f(r["int2_ms"] * 1e3), _f(r["sdpa_ms"] * 1e3),
               f"**{r['speedup']:.2f}×**", f"{r['int2_bytes_per_s'] / bw:.0%}", f"{r['sdpa_bytes_per_s'] / bw:.0%}"]
        if fi:
            row += [_f(r["flashinfer_ms"] * 1e3), f"**{r['flashinfer_speedup']:.2f}×**",
                    f"{r['flashinfer_bytes_per_s'] / bw:.0%}"] if "flashinfer_ms" in r else ["–", "–", "–"]
        if stream:
            row += [_f(r["int2_stream_ms"] * 1e3), _f(r["sdpa_stream_ms"] * 1e3), f"**{r['stream_speedup']:.2f}×**",
                    f"{r['int2_stream_bytes_per_s'] / bw:.0%}"]
            if fi:
                row += ([_f(r["flashinfer_stream_ms"] * 1e3), f"**{r['flashinfer_stream_speedup']:.2f}×**"]
                        if "flashinfer_ms" in r else ["–", "–"])
        rows.append(row)
    out += _table(["context", "batch", "INT2 µs", "SDPA BF16 µs (baseline)", "speed-up vs SDPA", "INT2 % of copy",
                   "SDPA % of copy"]
                  + (["FlashInfer BF16 µs (baseline 2)", "speed-up vs FlashInfer", "FlashInfer % of copy"] if fi else [])
                  + (["INT2 µs in stream", "SDPA µs in stream", "speed-up in stream", "INT2 % of copy in stream"]
                     + (["FlashInfer µs in stream", "speed-up vs FlashInfer in stream"] if fi else [])
                     if stream else []), rows)
    sdpa = {(r["context"], r["batch"]): r["sdpa_ms"] for r in doc["rows"] if "sdpa_ms" in r}
    extra = []
    for b in doc.get("breakdown", []):
        base = sdpa.get((b["context"], b["batch"]))
        if base:
            call = b["prerotated_ms"]  # the call less what the rotation kernel adds
            extra.append(f"the runtime's call at {_ctx(b['context'])} × 1 (query rotated by the write): "
                         f"{call * 1e3:.1f} µs, {base / call:.2f}× SDPA")
    for p in doc.get("paged", []):
        if "median_ratio" in p:
            extra.append(f"paged cache (page {p['page']}, shuffled) at {_ctx(p['context'])} × {p['batch']}: "
                         f"{(p['median_ratio'] - 1) * 100:+.1f}% against contiguous "
                         f"(median of {len(p['rounds'])} rounds)")
    w = next((w for w in doc.get("write", []) if w.get("name") == "rot+clip" and "ms" in w), None)
    if w:
        extra.append(f"write kernel (rotate + clip + quantise + pack, {w['tokens'] // 1024}K tokens × "
                     f"{doc['settings']['shape']['kv_heads']} heads at the bundled zoo's clip ratios): "
                     f"{w['ms'] * 1e3:.1f} µs, {w['bytes_per_s'] / bw:.0%} of copy")
    errs = [r["rel_err"] for r in doc["correctness"]["decode"]]
    extra.append(f"relative error against the float32 reference: {max(errs):.1e}")
    extra.append(flashinfer_note(doc))
    out += [""] + [f"- {e[0].upper()}{e[1:]}." for e in extra]
    ncu = [n for n in doc.get("ncu", []) if "first tuning" not in n["what"]]
    if ncu:
        out += ["", "What bounds each kernel (Nsight Compute, one call each at 128K, `--ncu`):", ""]
        out += _table(["call", "kernel", "µs", "DRAM % of peak", "issue active", "bound"],
                      [[n["what"], n["kernel"], _f((n["metrics"].get("time") or 0) / 1e3),
                        f"{n['metrics'].get('dram_pct') or 0:.0f}%", f"{n['metrics'].get('issue_pct') or 0:.0f}%",
                        n["metrics"]["bound"]] for n in ncu])
    return out + [""]


FI_FORMS = {"cuda_cores": "CUDA-core decode kernel", "tensor_cores": "tensor cores (`use_tensor_cores=True`)"}


def flashinfer_note(doc: dict) -> str:
    """The kernels page's line on the second baseline: what ran, or why it did not."""
    fi = doc.get("flashinfer")
    if fi is None:
        return "FlashInfer's BF16 decode (second baseline): not in this result (its run predates the baseline)"
    if not fi.get("available"):
        return f"FlashInfer's BF16 decode (second baseline): not timed in this run: {fi.get('skipped')}"
    forms = fi["check"]["forms"]
    timed = [r for r in doc["rows"] if "flashinfer_ms" in r]
    missing = [f"{_ctx(r['context'])} × {r['batch']} ({r['flashinfer_skipped']})" for r in doc["rows"]
               if "int2_ms" in r and "flashinfer_ms" not in r]
    won = {f: [f"{_ctx(r['context'])} × {r['batch']}" for r in timed if r["flashinfer_form"] == f] for f in forms}
    return (f"FlashInfer {fi['version']} BF16 decode: `BatchDecodeWithPagedKVCacheWrapper`, page {fi['page']}, "
            "the faster of its forms at each shape: "
            + "; ".join(f"{FI_FORMS.get(f, f)} (`{r['backend']}`, max |diff| against float32 SDPA "
                        f"{r['max_abs_diff']:.1e}): " + (", ".join(won[f]) or "none") if r["ok"]
                        else f"{FI_FORMS.get(f, f)} left out ({r['error']})" for f, r in forms.items())
            + (f"; not timed at {', '.join(missing)}" if missing else ""))


def append(doc: dict) -> list[str]:
    out = []
    if doc.get("rows"):
        variants = list(dict.fromkeys(r["variant"] for r in doc["rows"]))
        by = {(r["batch"], r["variant"]): r["us_per_call"] for r in doc["rows"]}
        out += ["`append_token`, µs per call (36 per graph):", ""]
        out += _table(["batch"] + [("torch reference (for scale)" if v == "torch reference" else v) for v in variants],
                      [[b] + [_f(by.get((b, v)), ".2f") for v in variants]
                       for b in sorted({r["batch"] for r in doc["rows"]})])
        out.append("")
    if doc.get("step"):
        methods = [m for m in dict.fromkeys(r["method"] for r in doc["step"]) if m != "BF16 cache + SDPA"]
        by = {(r["batch"], r["context"], r["method"]): r["us_per_layer"] for r in doc["step"]}
        shapes = list(dict.fromkeys((r["batch"], r["context"]) for r in doc["step"]))
        rows = []
        for b, c in shapes:
            base = by.get((b, c, "BF16 cache + SDPA"))
            runtime = by.get((b, c, "in append_token"))
            rows.append([f"{b} × {_ctx(c)}"] + [_f(by.get((b, c, m)), ".2f") for m in methods]
                        + [_f(base, ".2f"), f"**{base / runtime:.2f}×**" if base and runtime else "–"])
        out += ["Write + decode per layer, µs (the runtime's step is \"in append_token\"):", ""]
        out += _table(["batch × context"] + methods + ["BF16 cache + SDPA (baseline)",
                                                        "speed-up of the runtime's step vs baseline"], rows)
        out.append("")
    return out


def _fair(doc: dict) -> list[str]:
    bw = doc.get("copy_bandwidth")
    rows = []
    for r in doc["fair"]:
        if "speedup" not in r:
            continue
        for tag, label in (("", "no"), ("compiled_", "yes")):
            b, i = r[f"{tag}bf16_ms"], r[f"{tag}int2_loop_ms"]
            rows.append([f"{r['batch']} × {_ctx(r['tokens'])}", label, _f(r[f"{tag}bf16_sdpa_replay_ms"], ".2f"),
                         _f(r[f"{tag}bf16_flash_loop_ms"], ".2f"), _fi_cell(r, tag), _f(i, ".2f"),
                         f"**{r[f'{tag}speedup']:.2f}×**",
                         f"{r[f'{tag}bf16_roofline_pct']:.0f}% of {r['bf16_roofline_ms']:.2f}",
                         f"{r[f'{tag}int2_roofline_pct']:.0f}% of {r['int2_roofline_ms']:.2f}",
                         f"{1e3 * r['batch'] / b:.1f} / {1e3 * r['batch'] / i:.1f}"])
    out = [f"Decode step, ms (roofline: bytes read per step over {_f(bw and bw / 1e12, '.2f')} TB/s, the copy "
           "bandwidth measured in the same run):", ""]
    out += _table(["batch × context", "compiled", "BF16 SDPA replay", "BF16 flash loop", "BF16 FlashInfer replay",
                   "INT2 `DecodeGraph` loop", "INT2 speed-up vs BF16 (fastest BF16)", "BF16 roofline, ms",
                   "INT2 roofline, ms", "tok/s BF16 / INT2"], rows)
    fi = doc.get("flashinfer")
    if not isinstance(fi, dict):
        out += ["", "FlashInfer was not timed in this run."]
    elif fi.get("forms"):
        out += ["", f"FlashInfer {fi['version']}: `BatchDecodeWithPagedKVCacheWrapper` over pages of 16 tokens "
                "(the faster of its CUDA-core and tensor-core forms, named in the cell)."]
    else:
        out += ["", f"FlashInfer not timed: {fi.get('skipped') or fi.get('error') or 'no reason recorded'}."]
    return out + [""]


def _fi_cell(r: dict, tag: str) -> str:
    ms = r.get(f"{tag}bf16_flashinfer_replay_ms")
    if ms is None:
        return "–"
    form = r.get(f"{tag}flashinfer_form", "")
    return f"{ms:.2f} ({form.replace('_', ' ')})" if form else f"{ms:.2f}"


def _profile(doc: dict) -> list[str]:
    cats = list(dict.fromkeys(c for p in doc["profile"] for side in ("int2", "bf16")
                              for c in p.get(side, {}).get("by_category_ms", {})))
    counted = any(p.get(side, {}).get("launches") for p in doc["profile"] for side in ("int2", "bf16"))
    fair = {(r["batch"], r["tokens"]): r for r in doc.get("fair", [])}
    rows = []
    for p in doc["profile"]:
        for side, name, timed in (("int2", "INT2", "compiled_int2_loop_ms"),
                                  ("bf16", "BF16 (SDPA)", "compiled_bf16_sdpa_replay_ms")):
            if side in p:
                by, n = p[side]["by_category_ms"], p[side].get("launches")
                row = [f"{p['batch']} × {_ctx(p['tokens'])}", name] + [_f(by.get(c), ".2f") for c in cats] \
                    + [_f(p[side]["kernels_ms"], ".2f")]
                if counted:
                    wall = fair.get((p["batch"], p["tokens"]), {}).get(timed)
                    row += [_f(n, ".0f"), _f(1e3 * (wall - p[side]["kernels_ms"]) / n if wall and n else None, ".2f")]
                rows.append(row)
    intro = "Where a compiled step's time goes: kernel time per step by category, ms (eager steps under the torch profiler)"
    if counted:
        intro += (", the kernels a step launches, and the mean gap per launch, µs: the fair table's compiled time "
                  "(INT2 loop, SDPA replay) less the kernels' sum, over the launches (the INT2 loop's includes its "
                  "argmax and the copies into the graph's inputs):")
    else:                                            # a result from before the launches were counted
        intro += "; the loop's wall time above less this sum is the gaps between kernels, argmax and the host:"
    head = ["shape", "cache"] + cats + ["kernels"] + (["launches", "gap/launch µs"] if counted else [])
    return [intro, ""] + _table(head, rows) + [""]


def _capacity(doc: dict) -> list[str]:
    out = []
    for c in doc["capacity"]:
        if "int2_batch" not in c:
            continue
        out.append(f"Sequences of {_ctx(c['tokens'])} that fit beside the weights on this GPU ({c['free_gib']:.1f} GiB for caches, "
                   f"4 GiB kept for activations): BF16 {c['bf16_batch']} ({_f(c.get('bf16_tok_s'))} tok/s compiled), "
                   f"INT2 {c['int2_batch']} ({_f(c.get('int2_tok_s'))} tok/s compiled); the INT2 cache at 8 × 64K, "
                   f"which the BF16 cache cannot hold: {_f(c.get('int2_8x64k_tok_s'))} tok/s.")
    return out + [""] if out else []


def generate(doc: dict) -> list[str]:
    out = []
    if doc.get("fair"):
        out += _fair(doc)
    if doc.get("profile"):
        out += _profile(doc)
    if doc.get("capacity"):
        out += _capacity(doc)
    if doc.get("rows"):
        names = {"dynamic": "DynamicCache + SDPA (transformers' stock path)", "oscar": "OscarCache",
                 "quantized": "QuantizedCache (quanto, 2 bits)"}
        out += ["Eager `generate()` (wall clock; GPU busy: the sum of kernel times per step):", ""]
        out += _table(["batch × context", "cache", "decode tok/s", "GPU busy ms/step", "decode peak GiB"],
                      [[f"{r['batch']} × {_ctx(r['tokens'])}", names.get(r["cache"], r["cache"]),
                        "out of memory" if r.get("oom") else _f(r.get("tok_s")), _f(r.get("busy_ms"), ".2f"),
                        _f(r.get("peak_gib"), ".2f")] for r in doc["rows"]])
        out.append("")
    if doc.get("graph"):
        by = {(r["batch"], r["tokens"], r["cache"]): r for r in doc["graph"]}
        shapes = list(dict.fromkeys((r["batch"], r["tokens"]) for r in doc["graph"]))
        compiled = any("compiled_graph_tok_s" in r for r in doc["graph"])
        rows = []
        for b, t in shapes:
            s, o = by.get((b, t, "static+graph"), {}), by.get((b, t, "oscar+graph"), {})
            row = [f"{b} × {_ctx(t)}", "out of memory" if s.get("oom") else _f(s.get("graph_ms"), ".2f"),
                   _f(o.get("graph_ms"), ".2f"), _f(o.get("graph_tok_s"))]
            rows.append(row + ([_f(o.get("compiled_graph_tok_s"))] if compiled else []))
        out += ["One decode step replayed from a CUDA graph (GPU ms per step), and a greedy loop through "
                "`DecodeGraph` (wall tokens/s, argmax and host bookkeeping included):", ""]
        out += _table(["batch × context", "StaticCache + SDPA graph, ms (transformers' stock path)",
                       "OscarCache graph, ms", "`DecodeGraph` tok/s"]
                      + (["`DecodeGraph(compile=True)` tok/s"] if compiled else []), rows)
        out.append("")
    if doc.get("generate"):
        methods = list(dict.fromkeys(r["method"] for r in doc["generate"]))
        names = {"dynamic": "DynamicCache (stock)", "oscar": "OscarCache eager",
                 "oscar+graph": "`graph_decoding`", "oscar+graph+eos": "`graph_decoding`, EOS stop",
                 "oscar+graph+compile": "`graph_decoding`, `compile=True`"}
        by = {(r["batch"], r["tokens"], r["method"]): r.get("generate_tok_s") for r in doc["generate"]}
        shapes = list(dict.fromkeys((r["batch"], r["tokens"]) for r in doc["generate"]))
        out += ["`generate()` itself after a real prompt, decode tokens/s:", ""]
        out += _table(["prompt"] + [names.get(m, m) for m in methods],
                      [[f"{b} × {_ctx(t)}"] + [_f(by.get((b, t, m))) for m in methods] for b, t in shapes])
        out.append("")
    if doc.get("ttft"):
        out += ["Time to first token (real prefill, batch 1), seconds: "
                + "; ".join(f"{_ctx(r['tokens'])} {r['cache']} {r['ttft_s']:.2f}" for r in doc["ttft"] if "ttft_s" in r)
                + ".", ""]
    mc = {k: v for k, v in doc.get("max_context", {}).items() if isinstance(v, dict) and v.get("max_tokens")}
    if mc:
        out += ["Largest context that fits at batch 1: " + "; ".join(f"{k} {v['max_tokens']:,} tokens"
                                                                     for k, v in mc.items()) + ".", ""]
    return out


SHAPES = {"32b": "Qwen3-32B shape (64 layers, 64 query / 8 KV heads, head_dim 128; 32.8B parameters)",
          "8b": "Qwen3-8B shape (36 layers, 32 query / 8 KV heads, head_dim 128)",
          "nodes": "a small Qwen3-shaped model saved to disk (8 layers, hidden 1024, 16 query / 8 KV heads)",
          "small": "a tiny Qwen3-shaped model (the dry run's)"}


def _commit(c: str) -> str:
    """A full hash shortened as the harness writes it (``git rev-parse --short=7``)."""
    return c[:7] if len(c) == 40 and all(ch in "0123456789abcdef" for ch in c) else c


def _per_gpu(by_dev: dict, digits: int = 2) -> str:
    """``{"cuda:0": bytes, ...}`` as ``0.88 / 0.44 / ...`` GiB in GPU order."""
    def order(k):
        return (0, int(k.split(":")[1])) if k.startswith("cuda:") and k.split(":")[1].isdigit() else (1, k)

    return " / ".join(f"{by_dev[k] / 2**30:.{digits}f}" for k in sorted(by_dev, key=order)) or "–"


def _equal(r: dict) -> str:
    """The row's artifact and accumulators against its scenario's first row."""
    eq = r.get("equal_to_reference")
    if eq is None:
        return "(reference)"
    if "error" in eq:
        return f"not compared ({eq['error'][:80]})"
    art = ("artifact byte-identical" if eq["artifact_bytes_equal"] else
           f"artifact differs: {eq['tensors_differing']} of {eq['tensors']} tensors, max {eq['max_abs_diff']:.1e}")
    acc = ("accumulators bit-equal" if eq["accumulators_bit_equal"] else
           f"accumulators within {eq['accumulators_max_rel_diff']:.1e} (relative)")
    return f"{art}, {acc}"


def _gpus(n: int) -> str:
    return "1 GPU" if n == 1 else f"{n} GPUs"


def _repeats(n: int) -> str:
    return "one timed repeat" if n == 1 else f"medians of {n} timed repeats"


def _first_of_run(rows: list[dict], r: dict) -> dict:
    return next(x for x in rows if x.get("run") == r.get("run"))


def _error(text: str) -> str:
    """A scenario's error: its first clause and, from the log tail it carries (lines joined by
    `` | ``), the script's own progress lines (``[  45.9 s] msg``), numbers to two decimals."""
    head, _, tail = text.partition("; ")
    steps = [m.group(1) for m in (re.match(r"\[\s*[\d.]+ s\] (.*)", x.strip()) for x in tail.split(" | ")) if m]
    head = head[:160] + (f"; its last progress lines: {'; '.join(steps[-4:])}" if steps else "")
    return re.sub(r"(\d+\.\d\d)\d+", r"\1", head)


def _yes(flag) -> str:
    return "–" if flag is None else "byte-identical" if flag else "**differs**"


def scale(doc: dict) -> list[str]:
    runs = {r["run"]: r for r in doc.get("runs", [])}
    tagged = bool(runs)

    def who(r: dict) -> list[str]:  # the run column, where the file holds several runs
        return [f"{r['run']} (`{_commit(runs[r['run']]['commit'])}`)"] if tagged else []

    out = []
    if tagged:
        out += ["Rows from several runs of the script, each tagged with its run:", ""]
        out += [f"- run {n}: commit `{_commit(r['commit'])}`, {r['date'][:16].replace('T', ' ')} UTC, "
                f"`{r['command']}`" + (f". {r['note'][0].upper()}{r['note'][1:]}" if r.get("note") else "") + "."
                for n, r in sorted(runs.items())]
        out.append("")
    rows = [r for r in doc["rows"] if "error" not in r or r.get("partial")]
    run_col = ["run (commit)"] if tagged else []

    lay = [r for r in rows if r["scenario"] == "layouts" and "median_s" in r]
    if lay:
        first = lay[0]
        out += [f"Layouts: {SHAPES.get(first['shape'], first['shape'])}, {first['tokens']:,} calibration tokens in "
                f"sequences of {first['seq_len']}, {first['heldout_tokens']} held-out tokens; "
                f"{_repeats(len(first['times']['capture']))} after a warm-up `calibrate`. \"Fits\" is the work "
                "after the capture (rotations and clips) on rank 0; peaks are beyond the weights, per GPU:", ""]
        names = {"spread": "spread over {g}, 1 process", "ranks-x-spread": "{n} ranks × {g}",
                 "ranks": "{n} ranks, whole model each"}
        table = []
        for r in lay:
            m, t = r["median_s"], r["calibrate_timings"]
            table.append(who(r) + [
                names.get(r["layout"], r["layout"]).format(n=r["ranks"], g=_gpus(r["gpus_per_rank"])),
                _per_gpu(r["weights_bytes"], 1), f"{m['plain']:.2f}",
                f"{m['capture']:.2f} (**{r['overhead_capture']:+.0%}**)", f"{m['end_to_end']:.1f}",
                f"{t['rotations_and_clips_s']:.1f} ({t['fitted_layers']})",
                _per_gpu(r["peak_beyond_weights_bytes"]["capture"]),
                _per_gpu(r["peak_beyond_weights_bytes"]["end_to_end"]), _equal(r)])
        out += _table(run_col + ["layout", "weights per GPU, GiB", "plain forward s (baseline)",
                                 "capture s (overhead vs plain)", "whole calibrate s", "fits after capture s (layers)",
                                 "peak per GPU, capture, GiB", "peak per GPU, calibrate, GiB",
                                 "against the first layout"], table)
        for r in lay:
            if "verify" in r:
                v = r["verify"]
                out += ["", f"`oscar verify` on the {names.get(r['layout'], r['layout']).format(n=r['ranks'], g=_gpus(r['gpus_per_rank']))} "
                            f"layout (rank 0's model){' in run ' + str(r['run']) if tagged else ''}: "
                            f"{v['seconds']:.1f} s, {'passed' if v['passed'] else 'failed'} "
                            f"(attention error {v['summary']['mean_attn_error']:.3f} "
                            f"against Hadamard's {v['summary']['mean_attn_error_hadamard']:.3f}, random weights)."]
        out.append("")

    nodes = [r for r in rows if r["scenario"] == "torchrun" and "clean" in r]
    if nodes:
        first = nodes[0]
        out += [f"torchrun: two `torchrun --nnodes 2 --nproc-per-node {first['ranks_per_node']}` launchers on this "
                f"host, each with its own GPUs, running `oscar calibrate` on {SHAPES.get(first['shape'], first['shape'])}, "
                f"{first['tokens']:,} tokens in sequences of {first['seq_len']}, heartbeat "
                f"{first['heartbeat_s']:g} s; the reference is one process. While one rank is killed, the "
                "others sleep before each of their later batches, so only the heartbeat can stop them early:", ""]
        table = []
        for r in nodes:
            f, res = r.get("fault"), r.get("resume")
            clean = r["clean"]
            if f:
                within = f["survivors_stopped_within_s"]
                stops = [v for v in f["rank_stopped_after_kill_s"].values() if v is not None]
                kill = (f"rank {f['victim_rank']} after batch {f['die_after_batch']} of {f['batches_per_rank']}: "
                        + ("survivors not seen stopping" if within is None else
                           f"survivors stopped {min(stops):.1f}–{within:.1f} s after the kill")
                        + f"; their own sleeps alone last {f['survivors_would_need_s']:.0f} s")
                n = sum(len(v) for v in f["error_lines_by_rank"].values())
                lines = (f"{n} `error:` line{'' if n == 1 else 's'} "
                         f"(ranks {', '.join(sorted(f['error_lines_by_rank']))}), "
                         f"{sum(n['tracebacks_from_oscar'] for n in f['nodes'])} tracebacks from oscar")
            else:
                kill = lines = "–"
            table.append(who(r) + [f"2 × {r['ranks_per_node']}",
                                   f"{_yes(clean['artifact_bytes_equal_one_process'])} "
                                   f"(exit {' / '.join(str(n['exit_code']) for n in clean['nodes'])})",
                                   kill, lines,
                                   "–" if not res else f"{_yes(res['artifact_bytes_equal_one_process'])}, "
                                   f"{len(res['checkpoints_left'])} checkpoints left"])
        out += _table(run_col + ["nodes × ranks", "clean run against one process", "a rank killed",
                                 "what the survivors print", "`--resume` against one process"], table)
        out.append("")

    dp = [r for r in rows if r["scenario"] == "dp-scaling" and "median_s" in r]
    if dp:
        first = dp[0]
        out += [f"Data-parallel scaling: {SHAPES.get(first['shape'], first['shape'])}, one GPU per rank, "
                f"{first['tokens']:,} tokens in sequences of {first['seq_len']}, "
                f"{_repeats(len(first['times']['capture']))} after a warm-up `calibrate`; **baseline: the run's "
                "first rank count**:", ""]
        table = []
        for r in dp:
            m, sp = r["median_s"], r.get("speedup", {})
            table.append(who(r) + [r["ranks"], f"{m['plain']:.2f}", f"{m['capture']:.2f}",
                                   f"{r['tokens_per_s_capture']:,.0f}", f"{m['end_to_end']:.2f}",
                                   "(baseline)" if r is _first_of_run(dp, r) else
                                   f"**{sp['capture']:.2f}×** / **{sp['end_to_end']:.2f}×**" if sp else "–",
                                   _equal(r)])
        out += _table(run_col + ["ranks", "plain forward s", "capture s", "capture tok/s", "whole calibrate s",
                                 "speed-up vs the first, capture / calibrate", "against the first"], table)
        out.append("")

    failed = [r for r in doc["rows"] if "error" in r]
    if failed:
        out += ["Not finished:", ""]
        out += [f"- {'run ' + str(r['run']) + ', ' if tagged else ''}{r['scenario']}"
                f"{' ' + r['name'] if r.get('name') else ''}: {_error(r['error'])}." for r in failed]
        out.append("")
    return out


def first_run(doc: dict) -> list[str]:
    out = []

    def tree(path):
        return "this checkout" if path in ("/work/main", str(ROOT)) else "baseline"

    if doc.get("startup"):
        by = {(r["command"], tree(r["tree"])): r["median_s"] for r in doc["startup"]}
        cmds = list(dict.fromkeys(r["command"] for r in doc["startup"]))
        out += ["Start-up, median seconds (fresh interpreters):", ""]
        out += _table(["`oscar` command", "baseline", "this checkout"],
                      [[c, _f(by.get((c, "baseline")), ".2f"), _f(by.get((c, "this checkout")), ".2f")] for c in cmds])
        out.append("")
    runs = [r for p in ("demo", "quick") for r in doc.get(p, [])]
    if runs:
        out += ["`make demo`'s command (`calibrate smollm2-135m --device cpu`, verify included) and `--quick`:", ""]
        out += _table(["run", "wall s", "CPU s", "peak RSS MB", "load (1 min)"],
                      [[f"{r['part']}, {r['variant']}" + (f" #{r['repeat'] + 1}" if r["part"] == "demo" else ""),
                        _f(r["wall_s"]), _f(r["cpu_s"]), _f(r["peak_rss_mb"], ".0f"), _f(r["load_1min"])]
                       for r in runs])
        out.append("")
    if doc.get("accuracy"):
        out += ["Accuracy of the artifacts (verify's attention error; perplexity on the held-out text):", ""]
        out += _table(["artifact", "attention error", "Hadamard's", "ppl bf16", "ppl hadamard", "ppl oscar"],
                      [[r["artifact"], f"{r['verify_mean_attn_error']:.4f}",
                        f"{r['verify_mean_attn_error_hadamard']:.4f}",
                        f"{r['ppl']['bf16']:.3f}", f"{r['ppl']['hadamard']:.3f}", f"{r['ppl']['oscar']:.3f}"]
                       for r in doc["accuracy"]])
        out.append("")
    timed = [r for p in ("eval", "snippet") for r in doc.get(p, []) if "wall_s" in r]
    if timed:
        out += ["`oscar eval smollm2-135m zoo/smollm2-135m` with its defaults and the README's Python snippet, "
                "with when a person watching saw their first line and the longest stretch without one:", ""]
        out += _table(["run", "wall s", "CPU s", "first output s", "longest silence s", "load (1 min)"],
                      [[f"{'`oscar eval`' if r['part'] == 'eval' else 'README snippet'} #{r['repeat'] + 1}",
                        _f(r["wall_s"]), _f(r["cpu_s"]), _f(r.get("first_output_s")), _f(r.get("longest_silence_s")),
                        _f(r["load_1min"])] for r in timed])
        out.append("")
    for r in (r for r in doc.get("snippet", []) if "ratio_wall" in r):
        out += [f"The snippet's 2-bit `generate` (OscarCache) against plain `model.generate` ({r['prompt_tokens']}-token "
                f"prompt, 32 new tokens, {len(r['runs']) // 2} runs each, alternating, {r['threads']} threads): "
                f"median {r['median_wall_s']['oscar']:.1f} s against {r['median_wall_s']['plain']:.1f} s, "
                f"**{r['ratio_wall']:.2f}×** the time ({r['ratio_cpu']:.2f}× the CPU time), load "
                f"{r['load_1min']:.1f}.", ""]
    return out


def calibrate(doc: dict) -> list[str]:
    rows = [[r["tokens"], r.get("seq_len"), _f(r.get("median_plain_s", r.get("plain_s")), ".3f"),
             _f(r.get("median_capture_s", r.get("capture_s")), ".3f"), f"{r['overhead']:+.1%}"] for r in doc["rows"]]
    head = ["tokens", "seq len", "plain forward s (baseline)", "capture + accumulate s", "overhead"]
    return _table(head, rows) + [""]


RENDER = {"kernels": kernels, "append": append, "generate": generate, "calibrate": calibrate, "scale": scale,
          "first_run": first_run}


def render(folder: Path = RESULTS) -> str:
    docs = load_results(folder)
    lines = [INTRO.format(names=", ".join(f"`{b}`" for b in BENCHMARKS)).rstrip(), ""]
    for bench in BENCHMARKS:
        lines += [f"## {bench}", "", ABOUT[bench], "",
                  f"Script: `scripts/bench/bench_{bench}.py`.", ""]
        mine = [d for d in docs if d["benchmark"] == bench]
        if not mine:
            lines += [f"No current result in the tree: `python scripts/bench/run.py {bench} --save` makes one.", ""]
        for doc in mine:
            lines += [f"### {bench}, {doc['device']}", ""] + _source(doc) + RENDER[bench](doc)
            for name in plots.figures([doc]):
                alt = FIGURE_ALT[name.rsplit("-", 1)[1].removesuffix(".svg")]
                lines += [f"![{alt}, {doc['device']}]({FIGURES.relative_to(PAGE.parent).as_posix()}/{name})", ""]
    return "\n".join(lines).rstrip() + "\n"


def figures(folder: Path = RESULTS) -> dict[str, str]:
    """The page's figures, ``{file name: SVG text}`` (:func:`plots.figures` of the current results)."""
    return plots.figures(load_results(folder))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md differs from a fresh rendering")
    ap.add_argument("--results", default=str(RESULTS), help="folder of current results (default scripts/bench/results)")
    ap.add_argument("--page", default=str(PAGE), help="the page to write or check (default docs/benchmarks.md)")
    ap.add_argument("--figures", default=str(FIGURES), help="the folder of its figures (default docs/img/bench)")
    args = ap.parse_args(argv)
    text = render(Path(args.results))
    figs = figures(Path(args.results))
    page, folder = Path(args.page), Path(args.figures)
    have = {p.name for p in folder.glob("*.svg")} if folder.is_dir() else set()
    if args.check:
        stale = sorted(n for n, svg in figs.items() if not (folder / n).is_file() or (folder / n).read_text() != svg)
        stale += sorted(have - set(figs))
        if not page.is_file() or page.read_text() != text or stale:
            what = f"{page}" + (f" (figures {', '.join(stale)} in {folder})" if stale else "")
            print(f"error: {what} is not the rendering of {args.results}; run python scripts/bench/report.py",
                  file=sys.stderr)
            return 1
        return 0
    from oscar_calib.fsutil import atomic_write_text

    page.parent.mkdir(parents=True, exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    for name, svg in figs.items():
        atomic_write_text(folder / name, svg)
    for name in sorted(have - set(figs)):  # a figure whose result is gone
        (folder / name).unlink()
    atomic_write_text(page, text)
    print(f"wrote {page} and {len(figs)} figures in {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
