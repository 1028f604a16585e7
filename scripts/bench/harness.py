"""The pieces every benchmark under ``scripts/bench/`` shares: the device, timing, and one result format.

Device: :func:`describe_device` names the machine (``NVIDIA H100 80GB HBM3``) and gives it a slug
(``h100``, ``h200x2``, ``cpu``) that names its result file.

Timing (milliseconds, medians; inputs are the caller's, random, never zeros):

* :func:`bench_ms` times one call, rotating through several callables (one per input copy). On a
  GPU the L2 cache is emptied before every call: ``flush="write"`` is ``triton.testing.do_bench``
  (it zeroes a 256 MB buffer, so the call starts with L2 full of dirty lines), ``"read"`` sums a
  256 MB buffer instead (L2 left clean, as after the weight GEMM of a decode step), ``"none"``
  keeps L2 warm (each call between two CUDA events, synchronised after each). On the CPU (a
  ``--quick`` smoke run) it is the wall clock.
* :func:`graph_ms` warms the callables up, records each in a CUDA graph (so host launch overhead
  stays out, as in a serving engine's decode step) and times the replays with :func:`bench_ms`.
* :func:`stream_ms` times calls back to back inside one CUDA graph (over rotating copies), the
  cost of a call among others, as in a decode step, without :func:`graph_ms`'s per-call floor.
* :func:`rotating_copies` says how many copies of a working set make the timed calls read more than
  three L2 sizes, so no call finds its inputs cached.

Results: :func:`new_result` starts the one document every benchmark writes, ::

    {"schema": 1, "benchmark": "kernels", "device": "h100", "device_name": "NVIDIA H100 80GB HBM3",
     "commit": "8e6dd8a", "date": "2026-11-26T12:47:33+00:00", "command": "python scripts/bench/...",
     "versions": {"python", "torch", "triton", "transformers", "cuda", "gpu"},
     "settings": {...}, "rows": [...], ...}

and :func:`write_result` writes it atomically to ``--out`` (default ``$OUT`` or ``./bench_out``)
as ``{benchmark}-{device}.json``. An accepted run becomes the current result,
``scripts/bench/results/{benchmark}-{device}.json``, replacing the old one (history stays in git):
with ``--save`` on the machine that ran it, or later with ``python scripts/bench/run.py accept FILE``
(a file fetched from a GPU machine). A run of some sections keeps the other sections of the
current file and records where each came from (``carried``). The commit is ``$OSCAR_BENCH_COMMIT``
when set (a copy of the tree on a GPU machine, whose ``.git`` may be missing or lag the files), else
``git rev-parse`` of this checkout (``+dirty`` with uncommitted changes).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"
BENCHMARKS = ("kernels", "append", "generate", "calibrate", "scale", "first_run")
SCHEMA = 1
HEADER = ("schema", "benchmark", "device", "device_name", "commit", "date", "command", "versions", "settings")

if str(ROOT) not in sys.path:  # the benchmarks import oscar_calib from this checkout
    sys.path.insert(0, str(ROOT))


# ------------------------------------------------------------------------------------------ device
@dataclass(frozen=True)
class Device:
    """What a result was measured on. ``slug`` names the result file; ``count`` GPUs were used."""

    name: str
    slug: str
    count: int = 1
    cuda: bool = False
    l2_bytes: int = 4 << 20
    sms: int | None = None
    memory_gb: float | None = None
    capability: str | None = None

    def facts(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def device_slug(name: str, count: int = 1) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``h100``; with ``count`` 4 -> ``h100x4``; a CPU -> ``cpu``."""
    low = name.lower()
    if low.startswith("cpu") or not low:
        return "cpu"
    m = re.search(r"\b([a-z]{1,2}\d{2,4}[a-z]?)\b", low.replace("nvidia", ""))
    slug = m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", low).strip("-")
    return f"{slug}x{count}" if count > 1 else slug


def describe_device(*, cuda: bool, count: int = 1) -> Device:
    """GPU 0 when ``cuda`` (``count``: how many of its kind the benchmark uses), else the CPU."""
    if not cuda:
        proc = platform.processor() or platform.machine()
        return Device(name=f"cpu ({proc})", slug="cpu")
    import torch

    p = torch.cuda.get_device_properties(0)
    return Device(name=p.name, slug=device_slug(p.name, count), count=count, cuda=True,
                  l2_bytes=int(getattr(p, "L2_cache_size", 50 << 20)), sms=p.multi_processor_count,
                  memory_gb=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}")


def versions() -> dict:
    """Python, torch, Triton, transformers (installed versions; nothing imported but torch), CUDA, GPU."""
    out = {"python": platform.python_version()}
    for pkg in ("torch", "triton", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    try:
        import torch

        out["cuda"] = torch.version.cuda
        out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        out["cuda"] = out["gpu"] = None
    return out


def git_commit(root: Path = ROOT, env=None) -> str:
    """``$OSCAR_BENCH_COMMIT`` when set (in ``env``, default ``os.environ``): the commit a copied tree
    holds, which its ``.git`` may not say; else this checkout's commit (short), ``+dirty`` with
    uncommitted changes to tracked files; else ``unknown``."""
    given = (os.environ if env is None else env).get("OSCAR_BENCH_COMMIT")
    if given:
        return given
    try:
        head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10)
        if head.returncode == 0 and head.stdout.strip():
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                   capture_output=True, text=True, timeout=30)
            return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def run_program(main) -> None:
    """Run a benchmark's ``main()`` as a program (``python scripts/bench/NAME.py``, ``run.py``).

    ``--quick`` runs the Triton kernels on CPU tensors under Triton's interpreter, which Triton
    picks when a kernel module is imported (``TRITON_INTERPRET``), so it must be set before any
    kernel loads. The process is the program's own, so it is set here; ``main(argv)`` never
    changes the environment, since a test calls it inside pytest's process, whose later tests
    must find that process as it was (:func:`quick_interpreter` checks it instead)."""
    if "--quick" in sys.argv[1:]:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    raise SystemExit(main())


@contextlib.contextmanager
def environment(values: dict):
    """``values`` set where unset, for the block and the processes it starts; afterwards the
    environment is as it was (a benchmark's ``main()`` may run in its caller's process: the tests)."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def quick_interpreter() -> None:
    """Refuse, in one line, a ``--quick`` run in a process that does not run Triton under its CPU
    interpreter (``main()`` called from a process the caller made: set ``TRITON_INTERPRET=1``
    before it imports any kernel), or whose interpreter cannot run the kernels."""
    from oscar_calib.kernels import interpreter_problem, interpreting

    if not interpreting():
        raise SystemExit("error: --quick runs the kernels under Triton's CPU interpreter, chosen when the process "
                         "starts: run the script as a program, or set TRITON_INTERPRET=1 before calling main()")
    why = interpreter_problem()
    if why:
        raise SystemExit(f"error: --quick: {why}")


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# ------------------------------------------------------------------------------------------ timing
def sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def capture_graph(fn):
    """Run ``fn`` once on a side stream (warm-up), then record it in a CUDA graph; returns the graph."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


FLUSHES = ("write", "read", "none")
_READ_BUF: list = []


def _events_ms(step, *, reps: int, warmup: int, before=None) -> float:
    import torch

    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        if before is None:            # each call alone: what it takes from its submit to its end
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            times.append((a, b))
    if before is not None:
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) for a, b in times]
    return float(statistics.median(times))


def _read_flush():
    import torch

    if not _READ_BUF:
        _READ_BUF.append((torch.ones(64 << 20, dtype=torch.float32, device="cuda"),
                          torch.empty((), dtype=torch.float32, device="cuda")))
    buf, sink = _READ_BUF[0]
    return lambda: torch.sum(buf, dim=0, out=sink)


def bench_ms(fns, *, cuda: bool, flush: str = "write", warmup: int = 25, reps: int = 100,
             cpu_reps: int = 2) -> float:
    """Median milliseconds of one call, rotating through ``fns`` (a callable or a list, one per input
    copy); ``flush``: how L2 is emptied before each call on a GPU (see the module's docstring)."""
    fns = fns if isinstance(fns, (list, tuple)) else [fns]
    i = [0]

    def step():
        fns[i[0] % len(fns)]()
        i[0] += 1

    if not cuda:
        ts = []
        for _ in range(cpu_reps):
            t = time.perf_counter()
            step()
            ts.append((time.perf_counter() - t) * 1e3)
        return float(statistics.median(ts))
    if flush == "write":
        import triton.testing

        return float(triton.testing.do_bench(step, warmup=warmup, rep=reps, return_mode="median"))
    if flush == "read":
        return _events_ms(step, reps=reps, warmup=warmup, before=_read_flush())
    if flush == "none":
        return _events_ms(step, reps=reps, warmup=warmup)
    raise ValueError(f"flush {flush!r}: expected one of {', '.join(FLUSHES)}")


def graph_ms(fns, *, cuda: bool, flush: str = "write", **kw) -> float:
    """Warm up ``fns``, record each in a CUDA graph and time the replays with :func:`bench_ms`
    (on the CPU: the calls themselves, ``cpu_reps`` of them)."""
    fns = fns if isinstance(fns, (list, tuple)) else [fns]
    if not cuda:  # the CPU smoke run: the calls themselves, no warm-up
        return bench_ms(fns, cuda=False, **kw)
    for f in fns:
        f()
    sync(cuda)
    graphs = [capture_graph(f) for f in fns]
    return bench_ms([g.replay for g in graphs], cuda=True, flush=flush, **kw)


def stream_ms(fns, *, cuda: bool, calls: int = 24, reps: int = 20, cpu_reps: int = 1) -> float:
    """Milliseconds per call of ``fns`` run back to back, as the layers of a decode step run them:
    one CUDA graph holds at least ``calls`` calls, cycling through ``fns`` (one per input copy,
    together over three L2 sizes, so each call reads what the calls before it have evicted);
    the median replay over the calls it holds. No per-call graph launch or event pair is
    counted (:func:`graph_ms` times one call alone, and so includes them: about 4.5 us on an
    H100 or H200, a graph of one trivial kernel). On the CPU: :func:`bench_ms`."""
    fns = fns if isinstance(fns, (list, tuple)) else [fns]
    if not cuda:
        return bench_ms(fns, cuda=False, cpu_reps=cpu_reps)
    for f in fns:
        f()
    sync(cuda)
    n = len(fns) * max(1, math.ceil(calls / len(fns)))
    graph = capture_graph(lambda: [fns[i % len(fns)]() for i in range(n)])
    return bench_ms([graph.replay], cuda=True, flush="none", warmup=3, reps=reps) / n


def rotating_copies(ws_bytes: int, l2_bytes: int, *, cuda: bool, cap: int = 16) -> int:
    """Copies of a ``ws_bytes`` working set that make the timed calls read three L2 sizes (1 on a CPU)."""
    if not cuda or ws_bytes >= 3 * l2_bytes:
        return 1
    return min(cap, math.ceil(3 * l2_bytes / max(1, ws_bytes)))


# ---------------------------------------------------------------------------------------- progress
class Clock:
    """Elapsed-time log lines (``[  12.3s] msg``) and a time budget."""

    def __init__(self, budget_s: float | None = None, stream=None):
        self.t0, self.budget_s, self.stream, self.lines = time.time(), budget_s, stream, []

    def elapsed(self) -> float:
        return time.time() - self.t0

    def log(self, msg: str) -> None:
        line = f"[{self.elapsed():7.1f}s] {msg}"
        self.lines.append(line)
        print(line, file=self.stream or sys.stdout, flush=True)

    def over_budget(self) -> bool:
        return self.budget_s is not None and self.elapsed() > self.budget_s


# ----------------------------------------------------------------------------------------- results
def add_output_args(ap: argparse.ArgumentParser) -> None:
    """``--out DIR`` and ``--save``, the same in every benchmark."""
    ap.add_argument("--out", default=None, metavar="DIR",
                    help="folder for the result JSON (default $OUT or ./bench_out)")
    ap.add_argument("--save", action="store_true",
                    help="accept the run: also write it to scripts/bench/results/BENCHMARK-DEVICE.json, "
                         "replacing the current result for this device")


def out_dir(args) -> Path:
    return Path(args.out) if getattr(args, "out", None) else Path(os.environ.get("OUT") or "bench_out")


def command_line(script: str | Path, argv: list[str] | None) -> str:
    """How the run was started, as a user would type it from the repository root."""
    p = Path(script).resolve()
    try:
        p = p.relative_to(ROOT)
    except ValueError:
        pass
    args = sys.argv[1:] if argv is None else list(argv)
    return shlex.join(["python", str(p), *args])


def new_result(benchmark: str, device: Device, *, script: str | Path, argv: list[str] | None,
               settings: dict | None = None) -> dict:
    """The header every result carries, and ``rows`` (the main table); the benchmark adds its own sections."""
    if benchmark not in BENCHMARKS:
        raise ValueError(f"benchmark {benchmark!r}: expected one of {', '.join(BENCHMARKS)}")
    return {"schema": SCHEMA, "benchmark": benchmark, "device": device.slug, "device_name": device.name,
            "commit": git_commit(), "date": now(), "command": command_line(script, argv), "versions": versions(),
            "settings": dict(settings or {}), "device_facts": device.facts(), "rows": []}


def result_path(benchmark: str, device: str, folder: Path = RESULTS) -> Path:
    return Path(folder) / f"{benchmark}-{device}.json"


def check_result(doc: dict, where: str = "result") -> dict:
    """``doc`` if it has every header key (its sections are the benchmark's own); else ValueError."""
    missing = [k for k in HEADER if k not in doc]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    if doc["schema"] != SCHEMA or doc["benchmark"] not in BENCHMARKS:
        raise ValueError(f"{where}: not a schema-{SCHEMA} benchmark result")
    return doc


def write_result(doc: dict, *, save: bool, out: Path | None = None, name: str | None = None) -> Path:
    """Write ``doc`` atomically to the folder ``out`` (``name``, default ``{benchmark}-{device}.json``)
    and, with ``save``, install it as the current result too (:func:`install_result`). Returns the
    path of the current result when saved, else the one in ``out``."""
    check_result(doc)
    path = Path(out or "bench_out") / (name or result_path(doc["benchmark"], doc["device"]).name)
    _write_json(path, doc)
    return install_result(doc) if save else path


def install_result(doc: dict, folder: Path = RESULTS) -> Path:
    """Make ``doc`` the current result of its benchmark and device (``{benchmark}-{device}.json``
    in ``folder``), replacing the old one. The sections the run did not measure (its
    ``not_measured`` keys) are taken from the old file where it has them, each recorded under
    ``carried`` with the commit, date and command that measured it."""
    check_result(doc)
    if doc["settings"].get("quick"):
        raise ValueError("a --quick run is a smoke test of the script; it is never a current result")
    path = result_path(doc["benchmark"], doc["device"], folder)
    doc = dict(doc)
    old = json.loads(path.read_text()) if path.is_file() else {}
    for key in doc.get("not_measured", []):
        if old.get(key) and not doc.get(key):            # an empty old section is nothing to carry
            doc[key] = old[key]
            origin = old.get("carried", {}).get(key) or {k: old.get(k) for k in ("commit", "date", "command")}
            doc["carried"] = {**doc.get("carried", {}), key: origin}
    _write_json(path, doc)
    return path


def _write_json(path: Path, doc: dict) -> None:
    from oscar_calib.fsutil import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(doc, indent=1, default=str) + "\n")


def load_results(folder: Path = RESULTS) -> list[dict]:
    """Every current result in ``folder`` (checked), sorted by benchmark then device; the path
    relative to the repository is under ``path``."""
    docs = []
    for p in sorted(Path(folder).glob("*.json")):
        doc = check_result(json.loads(p.read_text()), str(p))
        if p.name != result_path(doc["benchmark"], doc["device"]).name:
            raise ValueError(f"{p}: holds {doc['benchmark']} on {doc['device']}; its name must be "
                             f"{result_path(doc['benchmark'], doc['device']).name}")
        try:
            doc["path"] = str(p.resolve().relative_to(ROOT))
        except ValueError:
            doc["path"] = str(p)
        docs.append(doc)
    order = {b: i for i, b in enumerate(BENCHMARKS)}
    return sorted(docs, key=lambda d: (order[d["benchmark"]], d["device"]))
