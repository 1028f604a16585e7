#!/usr/bin/env python
"""A new user's first hour, timed: start-up of the light commands, ``make demo``, and
``oscar calibrate --quick`` with what it costs in accuracy. Optionally against another checkout
(``--baseline DIR``, e.g. ``git worktree add /tmp/base main``) in the same run, alternating.

    python scripts/bench/bench_first_run.py --parts startup --repeats 5 --baseline /tmp/base
    python scripts/bench/bench_first_run.py --parts demo,quick --repeats 2 --baseline /tmp/base
    python scripts/bench/bench_first_run.py --parts accuracy

Parts:

* ``startup``: wall time of ``--help``, ``zoo list``, ``zoo table``, ``validate zoo`` and
  ``export`` (fresh interpreters, medians of ``--repeats``).
* ``demo``: the command ``make demo`` runs (``calibrate smollm2-135m --device cpu``), wall time,
  CPU time and peak RSS of the whole process, per checkout (and per ``--baseline-env``); runs
  alternate between them.
* ``quick``: the same with ``--quick`` (this checkout only).
* ``accuracy``: a default and a ``--quick`` artifact (from ``demo``/``quick``, or made here),
  both checked with verify's default settings (serving layout, depths 512–2048, two sequences of
  the held-out half) and ``oscar eval`` perplexity (bf16, hadamard, oscar; 2 × 2048 held-out tokens).
* ``eval``: ``oscar eval smollm2-135m zoo/smollm2-135m`` with its defaults (the first ``next:``
  after a calibration), wall and CPU time.
* ``snippet``: the README's Python snippet as a script (wall and CPU time), and in one process
  ``generate`` through ``OscarCache`` against plain ``model.generate`` on its prompt (32 new tokens, alternating,
  ``--repeats`` each, medians and their ratio).

Every command's output is read as it comes: ``first_output_s`` (when its first line came) and
``longest_silence_s`` (the longest stretch without a line, the end included) say whether a person
watching it is kept informed. The machine is shared: every row records the load average before
it. Writes
``first_run-cpu.json`` (``harness.py``'s format; rows, each with its ``part``) to ``--out``
(default ``$OUT`` or ./bench_out), with ``--save`` also as the current result (the parts not run
are kept from it), and prints a table. The commands run with ``HF_HUB_OFFLINE=1`` and
``TOKENIZERS_PARALLELISM=false``, as the Makefile sets them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # imported rather than run (the tests)
    sys.path.append(str(Path(__file__).resolve().parent))

from harness import ROOT as HERE  # noqa: E402
from harness import add_output_args, describe_device, new_result, out_dir, write_result  # noqa: E402

PARTS = ("startup", "demo", "quick", "accuracy", "eval", "snippet")


def run(tree: Path, args: list[str], *, cwd: Path | None = None, extra_env: dict | None = None,
        argv: list[str] | None = None) -> dict:
    """``python -m oscar_calib ARGS`` (or ``argv``) from checkout ``tree``: wall time, CPU time,
    peak RSS, exit code, and when its output came (``first_output_s``, ``longest_silence_s``)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OSCAR_PROGRESS": "plain", **(extra_env or {})}
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv or [sys.executable, "-m", "oscar_calib", *args], env=env, cwd=cwd or tree,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen: list[float] = []
    texts = {"stdout": [], "stderr": []}

    def read(stream, name):
        for line in stream:
            seen.append(time.perf_counter() - t0)
            texts[name].append(line.decode(errors="replace"))

    readers = [threading.Thread(target=read, args=(proc.stdout, "stdout")),
               threading.Thread(target=read, args=(proc.stderr, "stderr"))]
    for r in readers:
        r.start()
    _, status, usage = os.wait4(proc.pid, 0)          # this child's own peak RSS
    wall = time.perf_counter() - t0
    for r in readers:
        r.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    times = sorted(seen)
    stdout, stderr = "".join(texts["stdout"]), "".join(texts["stderr"])
    return {"args": args or argv, "tree": str(tree), "wall_s": wall, "rc": proc.returncode, "load_1min": load,
            "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_mb": usage.ru_maxrss / 1024,
            "first_output_s": times[0] if times else None,
            "longest_silence_s": max(b - a for a, b in zip([0.0, *times], [*times, wall])),
            "stdout": stdout[-20000:], "stderr": stderr[-4000:]}


def readme_snippet(readme: Path) -> str:
    """The README's Python snippet (the first ```python block)."""
    text = readme.read_text()
    start = text.index("```python\n") + len("```python\n")
    return text[start:text.index("```", start)]


# generate through OscarCache against model.generate on the snippet's prompt, in one process, alternating
GENERATE_RATIO = """
import json, sys, time
from oscar_calib.model.load import load_model    # first, as the snippet: the package sets OMP_WAIT_POLICY before torch loads
from oscar_calib.runtime import OscarCache, generate
import torch
from pydoc_data.topics import topics
lm = load_model("smollm2-135m", device="cpu", dtype="bfloat16")
model, tok = lm.model, lm.tokenizer
ids = tok(topics["class"][:3000], return_tensors="pt").input_ids
rows = []
for r in range(int(sys.argv[1])):
    for name in ("oscar", "plain"):
        cache = OscarCache.from_artifact("zoo/smollm2-135m", model) if name == "oscar" else None
        c0, w0 = time.process_time(), time.perf_counter()
        if cache is None:
            model.generate(ids, max_new_tokens=32, do_sample=False)
        else:
            generate(model, ids, cache, max_new_tokens=32, do_sample=False)
        rows.append({"name": name, "repeat": r, "wall_s": time.perf_counter() - w0, "cpu_s": time.process_time() - c0})
print(json.dumps({"prompt_tokens": ids.shape[1], "threads": torch.get_num_threads(), "rows": rows}))
"""


def eval_default(repeats: int, tmp: Path) -> list[dict]:
    rows = []
    for r in range(repeats):
        res = run(HERE, ["eval", "smollm2-135m", str(HERE / "zoo" / "smollm2-135m"), "--device", "cpu", "--plot",
                         str(tmp / "eval.png")], cwd=tmp)
        rows.append({"part": "eval", "repeat": r, **_timing(res), "summary": res["stdout"].strip().splitlines()[-12:]})
    return rows


def snippet(repeats: int) -> list[dict]:
    rows = []
    for r in range(repeats):
        res = run(HERE, [], argv=[sys.executable, "-c", readme_snippet(HERE / "README.md")])
        rows.append({"part": "snippet", "what": "README snippet", "repeat": r, **_timing(res)})
    res = run(HERE, [], argv=[sys.executable, "-c", GENERATE_RATIO, str(repeats)])
    if res["rc"] != 0:
        raise SystemExit(f"the generate comparison failed: {res['stderr'][-800:]}")
    doc = json.loads(res["stdout"].strip().splitlines()[-1])
    med = {(n, k): statistics.median(x[k] for x in doc["rows"] if x["name"] == n)
           for n in ("oscar", "plain") for k in ("wall_s", "cpu_s")}
    rows.append({"part": "snippet", "what": "generate (OscarCache) vs model.generate", "load_1min": res["load_1min"],
                 "prompt_tokens": doc["prompt_tokens"], "threads": doc["threads"], "runs": doc["rows"],
                 "median_wall_s": {n: med[n, "wall_s"] for n in ("oscar", "plain")},
                 "median_cpu_s": {n: med[n, "cpu_s"] for n in ("oscar", "plain")},
                 "ratio_wall": med["oscar", "wall_s"] / med["plain", "wall_s"],
                 "ratio_cpu": med["oscar", "cpu_s"] / med["plain", "cpu_s"]})
    return rows


def _timing(res: dict) -> dict:
    return {k: res[k] for k in ("wall_s", "cpu_s", "rc", "load_1min", "first_output_s", "longest_silence_s",
                                "peak_rss_mb")}


def startup(trees: list[Path], repeats: int, tmp: Path) -> list[dict]:
    rows = []
    for label, args in (("--help", ["--help"]), ("zoo list", ["zoo", "list"]), ("zoo table", ["zoo", "table"]),
                        ("validate zoo", ["validate", "zoo"]),
                        ("export", ["export", str(HERE / "zoo" / "gemma3-270m"), "--out", "EXPORT", "--overwrite",
                                    "--clip", "k=0.96,v=0.92"])):
        for tree in trees:
            walls, loads = [], []
            for r in range(repeats):
                a = [str(tmp / f"export-{tree.name}") if x == "EXPORT" else x for x in args]
                res = run(tree, a)
                if res["rc"] != 0:
                    raise SystemExit(f"{label} failed in {tree}: {res['stderr'][-500:]}")
                walls.append(res["wall_s"])
                loads.append(res["load_1min"])
            rows.append({"part": "startup", "command": label, "tree": str(tree), "median_s": statistics.median(walls),
                         "runs_s": walls, "load_1min": loads})
    return rows


def demo(variants: list[tuple[str, Path, dict]], repeats: int, tmp: Path, quick: bool) -> list[dict]:
    """``variants``: (label, checkout, extra environment), run in turn ``repeats`` times."""
    rows = []
    for r in range(repeats):
        for label, tree, extra_env in variants:
            out = tmp / f"{'quick' if quick else 'demo'}-{label}"
            args = ["calibrate", "smollm2-135m", "--out", str(out), "--overwrite", "--device", "cpu"]
            res = run(tree, args + (["--quick"] if quick else []), extra_env=extra_env)
            stages = [ln for ln in res["stderr"].splitlines() if ": done in " in ln]
            rows.append({"part": "quick" if quick else "demo", "variant": label, "tree": str(tree), "repeat": r,
                         "env": extra_env, **_timing(res), "out": str(out), "stages": stages,
                         "summary": res["stdout"].strip().splitlines()[-4:]})
    return rows


def accuracy(tmp: Path, demo_dir: Path | None, quick_dir: Path | None) -> list[dict]:
    arts = {}
    for name, given, extra in (("default", demo_dir, []), ("quick", quick_dir, ["--quick"])):
        arts[name] = given or tmp / f"acc-{name}"
        if given is None:
            run(HERE, ["calibrate", "smollm2-135m", "--out", str(arts[name]), "--overwrite", "--device", "cpu",
                       "--no-verify", *extra])
    rows = []
    for name, art in arts.items():
        v = run(HERE, ["verify", str(art), "--device", "cpu", "--json"])
        e = run(HERE, ["eval", "smollm2-135m", str(art), "--methods", "bf16,hadamard,oscar", "--device", "cpu",
                       "--plot", str(tmp / f"eval-{name}.png"), "--json"], cwd=tmp)
        vs, es = json.loads(v["stdout"])["summary"], json.loads(e["stdout"])["rows"]
        rows.append({"part": "accuracy", "artifact": name, "verify_mean_attn_error": vs["mean_attn_error"],
                     "verify_mean_attn_error_hadamard": vs["mean_attn_error_hadamard"],
                     "verify_mean_logit_error": vs["mean_logit_error"],
                     "ppl": {r["method"]: r["ppl"] for r in es}, "load_1min": [v["load_1min"], e["load_1min"]]})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="startup,demo,quick,accuracy")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--baseline", type=Path, help="another checkout to time in the same run (alternating)")
    ap.add_argument("--baseline-env", action="append", default=[], metavar="KEY=VALUE",
                    help="also time the baseline with this environment (repeatable), e.g. OMP_WAIT_POLICY=PASSIVE")
    add_output_args(ap)
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    if not set(parts) <= set(PARTS):
        raise SystemExit(f"error: --parts takes {', '.join(PARTS)}, got {args.parts!r}")
    trees = [HERE] + ([args.baseline.resolve()] if args.baseline else [])
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="oscar-first-run-") as t:
        tmp = Path(t)
        if "startup" in parts:
            rows += startup(trees, args.repeats, tmp)
        variants = [("this", HERE, {})]
        if args.baseline:
            variants.insert(0, ("baseline", args.baseline.resolve(), {}))
            if args.baseline_env:
                variants.insert(1, ("baseline+env", args.baseline.resolve(),
                                    dict(kv.split("=", 1) for kv in args.baseline_env)))
        if "demo" in parts:
            rows += demo(variants, args.repeats, tmp, quick=False)
        if "quick" in parts:
            rows += demo([("this", HERE, {})], args.repeats, tmp, quick=True)
        if "accuracy" in parts:
            last = lambda part: next((Path(r["out"]) for r in reversed(rows)          # noqa: E731
                                      if r["part"] == part and r["tree"] == str(HERE) and r["rc"] == 0), None)
            rows += accuracy(tmp, last("demo"), last("quick"))
        if "eval" in parts:
            rows += eval_default(args.repeats, tmp)
        if "snippet" in parts:
            rows += snippet(args.repeats)
    settings = {"parts": parts, "repeats": args.repeats, "baseline": str(args.baseline) if args.baseline else None,
                "baseline_env": args.baseline_env, "cpus": os.cpu_count()}
    doc = new_result("first_run", describe_device(cuda=False), script=__file__, argv=argv, settings=settings)
    del doc["rows"]  # one section per part, so a run of some parts keeps the others' rows when saved
    doc.update({p: [r for r in rows if r["part"] == p] for p in PARTS},
               not_measured=[p for p in PARTS if p not in parts])
    path = write_result(doc, save=args.save, out=out_dir(args))
    for r in rows:
        if r["part"] == "startup":
            print(f"startup  {r['command']:<14} {Path(r['tree']).name:<14} median {r['median_s']:.2f} s  "
                  f"runs {['%.2f' % x for x in r['runs_s']]}  load {['%.1f' % x for x in r['load_1min']]}")
        elif r["part"] in ("demo", "quick"):
            rss = f"{r['peak_rss_mb']:.0f} MB"
            print(f"{r['part']:<8} {r['variant']:<14} #{r['repeat']} wall {r['wall_s']:6.1f} s  CPU {r['cpu_s']:6.1f} s  "
                  f"peak RSS {rss}  rc {r['rc']}  first output {r['first_output_s'] or 0:.1f} s  longest silence "
                  f"{r['longest_silence_s']:.1f} s  load {r['load_1min']:.1f}")
        elif r["part"] == "accuracy":
            print(f"accuracy {r['artifact']:<8} verify attn {r['verify_mean_attn_error']:.4f} (Hadamard "
                  f"{r['verify_mean_attn_error_hadamard']:.4f})  ppl {json.dumps(r['ppl'])}")
        elif "ratio_wall" in r:
            print(f"snippet  generate: 2-bit / plain median wall {r['ratio_wall']:.2f}x, CPU {r['ratio_cpu']:.2f}x "
                  f"({json.dumps({k: round(v, 1) for k, v in r['median_wall_s'].items()})} s)  "
                  f"load {r['load_1min']:.1f}")
        else:
            print(f"{r['part']:<8} #{r['repeat']} wall {r['wall_s']:6.1f} s  CPU {r['cpu_s']:6.1f} s  rc {r['rc']}  "
                  f"first output {r['first_output_s'] or 0:.1f} s  longest silence {r['longest_silence_s']:.1f} s  "
                  f"load {r['load_1min']:.1f}")
    print(f"JSON: {path}")


if __name__ == "__main__":
    main()
