#!/usr/bin/env python
"""Build the FlashInfer bundle that ``bench_kernels.py``'s second baseline needs on a GPU machine
without network access, on this machine (no GPU needed; nvcc and pip are).

The GPU machine (Python 3.12, torch 2.11 + CUDA 13, nvcc, no ``apache-tvm-ffi``) can take only what
a ``run`` call carries (64 MiB with the tree), and flashinfer-python 0.7.4's wheel unpacks to
717 MB. So this script: unpacks the wheel; compiles, with the local nvcc for sm_90a, the two
modules the benchmark loads (``get_batch_decode_module`` and the FA2 ``get_batch_prefill_module``
for BF16, head_dim 128) and places each ``.so`` in ``flashinfer/data/aot/<uri>/``, where
``flashinfer.jit.env.get_aot_artifacts`` finds it, so nothing is compiled there; keeps the Python
package (without the ``.cu`` sources of other kernels), the ``data/csrc`` files the two generators
read and the headers their compilation included (from ninja's dependency log, so a JIT rebuild
there also works); packs it as ``OUT/fi_site.tar.xz`` beside the wheels of ``--wheel-dir``
(``apache-tvm-ffi`` for cp312 at least) and ``OUT/setup.sh``, which unpacks it into
``/root/fisite`` and installs the wheels the venv lacks. Usage::

    python scripts/dev/flashinfer_bundle.py --wheel flashinfer_python-0.7.4-py3-none-any.whl \\
        --wheel-dir WHEELS --host-tvm-ffi apache_tvm_ffi-...-cp311-...whl --out .fi   # ~6-8 min on 2 cores

``--host-tvm-ffi`` is the ``apache-tvm-ffi`` wheel for this machine's Python (the generators import
it). Then, on the GPU machine, with ``.fi`` ignored by git and named in ``carry``:
``bash .fi/setup.sh && PYTHONPATH=.:/root/fisite python scripts/bench/bench_kernels.py ...``.
The link step names ``-lcuda``; a machine whose toolkit has no driver stub gets an empty one
(soname ``libcuda.so.1``; the modules use only the runtime API, so nothing is taken from it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ARCH = "9.0a"
SETUP = r"""#!/bin/bash
# Unpack the trimmed flashinfer-python (its BF16 decode modules prebuilt for sm_90a in
# flashinfer/data/aot) and the wheels the venv lacks into /root/fisite (FISITE). Idempotent.
set -e
HERE=$(cd "$(dirname "$0")" && pwd)
D=${FISITE:-/root/fisite}
SUM=$(md5sum "$HERE/fi_site.tar.xz" | cut -c1-32)
if [ "$(cat "$D/.done" 2>/dev/null)" != "$SUM" ]; then
  SECONDS=0
  rm -rf "$D" && mkdir -p "$D"
  tar -C "$D" -xJf "$HERE/fi_site.tar.xz"
  need=()
  for w in "$HERE"/wheels/*.whl; do
    b=$(basename "$w"); n=${b%%-*}
    case $n in apache_tvm_ffi) m=tvm_ffi;; nvidia_ml_py) m=pynvml;; *) m=$n;; esac
    python -c "import $m" 2>/dev/null && echo "fisite: $m already in the venv" || need+=("$w")
  done
  [ ${#need[@]} -gt 0 ] && pip install -q --no-deps --no-index --target "$D" "${need[@]}"
  echo "$SUM" > "$D/.done"
  echo "fisite: ready in ${SECONDS} s"
fi
"""
# what the benchmark builds: (generator module, function, arguments after the dtypes)
BUILD = r"""
import json, sys, torch
from flashinfer.jit.attention.modules import gen_batch_decode_module
from flashinfer.prefill import _gen_batch_prefill_independent_paged_module, _gen_batch_prefill_primary_module
bf = (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, 128, 128, 0, False, False)
seen = set()
sys.addaudithook(lambda ev, a: ev == "open" and isinstance(a[0], str) and "/flashinfer/data/csrc/" in a[0]
                 and seen.add(a[0]))
specs = [gen_batch_decode_module(*bf), _gen_batch_prefill_primary_module("fa2", *bf, False)]
_gen_batch_prefill_independent_paged_module("fa2", *bf, False)  # generated at load, built only on demand
for s in specs:
    s.build()
print(json.dumps({"modules": [[s.name, str(s.get_library_path()), str(s.build_dir)] for s in specs],
                  "csrc": sorted(seen)}))
"""


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, text=True, **kw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wheel", required=True, type=Path, help="flashinfer_python-*.whl")
    ap.add_argument("--wheel-dir", required=True, type=Path,
                    help="folder of cp312 wheels to ship (apache-tvm-ffi and any other the GPU venv lacks)")
    ap.add_argument("--host-tvm-ffi", required=True, type=Path, help="apache-tvm-ffi wheel for this Python")
    ap.add_argument("--out", required=True, type=Path, help="output folder (e.g. .fi, ignored by git)")
    ap.add_argument("--cuda-home", default=os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    args = ap.parse_args(argv)
    for p in (args.wheel, args.wheel_dir, args.host_tvm_ffi):
        if not p.exists():
            raise SystemExit(f"error: {p} does not exist")
    if not any(args.wheel_dir.glob("apache_tvm_ffi-*cp312*.whl")):
        raise SystemExit(f"error: {args.wheel_dir} holds no apache_tvm_ffi cp312 wheel (the GPU venv has none)")
    if (args.out / "fi_site.tar.xz").exists():
        raise SystemExit(f"error: {args.out / 'fi_site.tar.xz'} exists; remove it or name another --out")
    with tempfile.TemporaryDirectory(prefix="fibundle-") as tmp:
        tmp = Path(tmp)
        full, host, site = tmp / "full", tmp / "host", tmp / "site"
        with zipfile.ZipFile(args.wheel) as z:
            z.extractall(full)
        run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(host),
             str(args.host_tvm_ffi), *map(str, args.wheel_dir.glob("nvidia_ml_py-*.whl"))])
        stub = tmp / "stub"
        stub.mkdir()
        (stub / "e.c").write_text("")
        run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(stub / "libcuda.so"), str(stub / "e.c")])
        env = {**os.environ, "FLASHINFER_CUDA_ARCH_LIST": ARCH, "CUDA_HOME": args.cuda_home,
               "LIBRARY_PATH": f"{stub}:{os.environ.get('LIBRARY_PATH', '')}", "FLASHINFER_WORKSPACE_BASE": str(tmp),
               "PYTHONPATH": f"{full}:{host}"}
        print("compiling the decode and prefill modules for sm_90a (minutes) ...", flush=True)
        import json

        info = json.loads(run([sys.executable, "-c", BUILD], env=env, stdout=subprocess.PIPE).stdout.splitlines()[-1])
        keep = {str(Path(p).relative_to(full)) for p in info["csrc"]}
        for _, _, build_dir in info["modules"]:
            deps = run(["ninja", "-C", build_dir, "-t", "deps"], stdout=subprocess.PIPE).stdout
            keep |= {str(Path(w).relative_to(full)) for w in deps.split() if w.startswith(f"{full}/flashinfer/data/")}
        skip = ("flashinfer/data/csrc", "flashinfer/data/cutlass", "flashinfer/data/spdlog", "flashinfer/data/cccl")
        for src in full.rglob("*"):
            rel = str(src.relative_to(full))
            if src.is_dir() or "__pycache__" in rel or not rel.startswith("flashinfer"):
                continue
            if rel in keep or not (rel.startswith(skip) or rel.endswith(".cu")):
                (site / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, site / rel)
        for name, lib, _ in info["modules"]:
            (site / "flashinfer/data/aot" / name).mkdir(parents=True)
            shutil.copy2(lib, site / "flashinfer/data/aot" / name / f"{name}.so")
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "wheels").mkdir(exist_ok=True)
        part = args.out / "fi_site.tar.xz.part"
        run(["tar", "-C", str(site), "-cJf", str(part), *sorted(p.name for p in site.iterdir())])
        part.rename(args.out / "fi_site.tar.xz")
        for w in args.wheel_dir.glob("*.whl"):
            shutil.copy2(w, args.out / "wheels" / w.name)
        (args.out / "setup.sh").write_text(SETUP)
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"wrote {args.out}: {size / 2**20:.1f} MiB ({', '.join(n for n, _, _ in info['modules'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
