#!/usr/bin/env python
"""Static instruction counts of the INT2 kernels, on a machine without a GPU.

Compiles a kernel for an NVIDIA target (default sm_90, Hopper) with the installed Triton, which
ships its own ``ptxas`` and ``nvdisasm``, disassembles the cubin and reports the registers, the
shared memory and each loop of the SASS: its instruction count and, for the main loop, the opcode
mix and the instructions per cached token. The decode kernel at batch 1 is bound by its
dependent instruction stream (docs/design/kernels.md), so the main loop's count is a first
measure of a change before any GPU time is spent; the GPU benchmark (``bench_kernels.py``) has
the last word.

Kernels:

* ``decode``: the history part of the decode kernel (``PARTS=1``) in the library's batch-1
  regime (``decode.TUNING["small"]``: 64-token steps, one KV head per program, prefetch, PDL,
  the register cap), Qwen3-8B head shapes (d = 128, G = 128, 4 query heads per KV head); the
  batch-32 regime is ``--set HP=2 --maxnreg 0``, a paged cache ``--set PAGED=1 --set PAGE=64``,
  the logit-noise correction ``--set CORR=1``;
* ``write``: the plane-wise write kernel with a rotation and the clip (the library default:
  a persistent program holding the rotation, one split product, tournament selection, codes by
  thresholds), 64 rows per block; its first loop is the one over row blocks, which holds the
  clip-selection rounds (run ``m`` times) and the tie-aware fallback (rarely run) as inner loops.

``--set NAME=VALUE`` overrides a constexpr (e.g. ``BN=32``, ``SORTED=0``); ``--maxnreg`` /
``--num-stages`` / ``--num-warps`` the compile options. The numbers come from the local Triton,
which may differ from the GPU machine's: compare variants under one Triton.

Usage: ``python scripts/dev/kernel_sass.py [decode|write] [--set BN=32] [--json]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

POINTERS = {
    "decode": {"q_ptr": "*fp32", "kc_ptr": "*u8", "ks_ptr": "*fp16", "ko_ptr": "*fp16", "vc_ptr": "*u8",
               "vs_ptr": "*fp16", "vo_ptr": "*fp16", "tab_ptr": "*i32", "hlen_ptr": "*i32", "k16_ptr": "*bf16",
               "v16_ptr": "*bf16", "len16_ptr": "*i32", "op_ptr": "*fp32", "lse_ptr": "*fp32"},
    "write": {"x_ptr": "*bf16", "r1_ptr": "*bf16", "r2_ptr": "*bf16", "kidx_ptr": "*i32", "c_ptr": "*fp32",
              "codes_ptr": "*u8", "scale_ptr": "*fp16", "off_ptr": "*fp16"},
}


def defaults(kernel: str) -> tuple[dict, dict]:
    """(constexprs, compile options) of the library's choice."""
    if kernel == "decode":
        from oscar_calib.kernels.decode import TUNING

        t = TUNING["small"]
        const = dict(D=128, G=128, W=32, NB=1, GV=128, WV=32, NBV=1, SPLIT=False, M2=4, HP=1, M16=16,
                     BN=t["BLOCK_N"], BLOCK16=t["BLOCK16"], PAGED=False, PAGE=1, ASM=True, INTERP=False, PARTS=1, PF=bool(t["prefetch"]), PDL=bool(t["pdl"]), V16=True, P32=False,
                     L2T=0, L2CS=4, L2PS=64, WS=int(t["window_stages"]), LATE=False, CORR=False)
        return const, {"num_warps": 1, "num_stages": t["num_stages"], "maxnreg": t["maxnreg"] or None}
    from oscar_calib.kernels import write
    from oscar_calib.kernels.write import RESIDENT_TILE as tile

    const = dict(D=128, G=128, W=32, BT=tile["BT"], KB=64, ROT=1, CLIP=True, INTERP=False, KEYED=False, SPLIT=True,
                 SORTED=True, RES=True, THRESH=True, LATE=True, TOP3=write.DEFAULT_SELECT_TOP3,
                 CHECKT=write.DEFAULT_CHECK_THRESHOLDS, SIGNS=write.DEFAULT_SIGN_BITS, CENTER=False)
    return const, {"num_warps": tile["num_warps"], "num_stages": tile["num_stages"], "maxnreg": None}


def compile_kernel(kernel: str, const: dict, opts: dict, arch: int):
    import triton
    from triton.backends.compiler import GPUTarget

    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # (the default; silences a notice of Triton 3.9)
    from oscar_calib.kernels.testing import jit_kernel

    fn = jit_kernel(kernel)
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name in POINTERS[kernel]:
            sig[name] = POINTERS[kernel][name]
            attrs[(i,)] = [["tt.divisibility", 16]]  # as torch allocations are
        elif name in ("qk_scale", "corr_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("s_") or name in ("CHUNK", "CHUNK16"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={k: v for k, v in opts.items() if v})


def tool(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.is_file():
        raise SystemExit(f"error: {path} not found (this Triton install ships no {name})")
    return str(path)


def disassemble(cubin: bytes) -> tuple[str, str]:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "k.cubin"
        p.write_bytes(cubin)
        sass = subprocess.run([tool("nvdisasm"), "-c", str(p)], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([tool("cuobjdump"), "-res-usage", str(p)], capture_output=True, text=True).stdout
    return sass, res


def parse(sass: str) -> tuple[list[tuple[int, str]], list[dict]]:
    """Instructions ``(address, text)`` and the loops, largest first: bodies of *predicated*
    backward branches (the back edges Triton's loops compile to; the unconditional backward
    branches that end the out-of-line divergent-path stubs are not loops)."""
    insts, labels, pending = [], {}, []
    for line in sass.splitlines():
        lab = re.match(r"^\s*(\.L_x_\d+):", line)
        if lab:
            pending.append(lab.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,6})\*/\s+(.*?)\s*;", line)
        if m:
            ad = int(m.group(1), 16)
            for p in pending:
                labels[p] = ad
            pending = []
            insts.append((ad, m.group(2)))
    loops = []
    for ad, text in insts:
        t = re.match(r"@!?P\d\s+BRA\b[^`]*`\((\.L_x_\d+)\)", text)
        if t and labels.get(t.group(1), ad + 1) < ad:
            lo = labels[t.group(1)]
            body = [x for a, x in insts if lo <= a <= ad]
            loops.append({"start": lo, "end": ad, "instructions": len(body), "body": body})
    loops.sort(key=lambda lp: -lp["instructions"])
    return insts, loops


def opcode(text: str) -> str:
    text = re.sub(r"^@!?U?P\w+\s+", "", text.strip())
    return text.split()[0].split(".")[0] if text else ""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel", nargs="?", default="decode", choices=["decode", "write"])
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="override a constexpr (ints; 0/1 for flags); repeatable")
    ap.add_argument("--maxnreg", type=int, default=None, help="register cap (0: none; default the library's)")
    ap.add_argument("--num-stages", type=int, default=None)
    ap.add_argument("--num-warps", type=int, default=None)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (default 90)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    const, opts = defaults(args.kernel)
    for item in args.set:
        name, sep, val = item.partition("=")
        if not sep or name not in const:
            sys.exit(f"error: --set {item!r}: expected NAME=VALUE with NAME one of {sorted(const)}")
        try:
            v = int(val)
        except ValueError:
            sys.exit(f"error: --set {item!r}: VALUE must be an integer")
        const[name] = bool(v) if isinstance(const[name], bool) else v
    for key, val in (("maxnreg", args.maxnreg), ("num_stages", args.num_stages), ("num_warps", args.num_warps)):
        if val is not None:
            opts[key] = val
    step_tokens = const["BN"] if args.kernel == "decode" else const["BT"]
    try:
        c = compile_kernel(args.kernel, const, opts, args.arch)
    except Exception as e:  # noqa: BLE001 - a compile error is the answer for this variant
        sys.exit(f"error: the {args.kernel} kernel does not compile with {const}, {opts}: "
                 f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    sass, res = disassemble(c.asm["cubin"])
    insts, loops = parse(sass)
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    out = {"kernel": args.kernel, "arch": f"sm_{args.arch}", "constexprs": const,
           "options": {k: v for k, v in opts.items() if v}, "registers": int(regs.group(1)) if regs else None,
           "stack_bytes": int(stack.group(1)) if stack else None, "dynamic_shared_bytes": c.metadata.shared,
           "instructions": len(insts), "tokens_per_step": step_tokens,
           "loops": [{k: v for k, v in lp.items() if k != "body"} for lp in loops]}
    if loops and args.kernel == "decode":  # (the write kernel's loops are clip-selection rounds)
        main_loop = loops[0]
        out["main_loop"] = {"instructions": main_loop["instructions"],
                            "per_token": main_loop["instructions"] / (step_tokens * const["HP"]),
                            "opcodes": dict(collections.Counter(opcode(x) for x in main_loop["body"]).most_common())}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{args.kernel} kernel, sm_{args.arch}: {out['registers']} registers, stack {out['stack_bytes']} B, "
          f"{out['dynamic_shared_bytes']} B shared, {len(insts)} instructions")
    for lp in out["loops"]:
        print(f"  loop {lp['start']:#07x}-{lp['end']:#07x}: {lp['instructions']} instructions")
    if "main_loop" in out:
        ml = out["main_loop"]
        print(f"main loop: {ml['instructions']} instructions per step of {step_tokens} tokens x {const['HP']} "
              f"KV head(s) ({ml['per_token']:.1f} per token and KV head)")
        print("  " + ", ".join(f"{k} {v}" for k, v in list(ml["opcodes"].items())[:16]))


if __name__ == "__main__":
    main()
