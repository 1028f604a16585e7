"""scripts/dev/kernel_sass.py: the kernels compile for sm_90 without a GPU and their SASS is counted.

The compiling runs in a process of its own: it needs the kernels defined without the Triton
interpreter, which this test session has switched on. Bad input is refused in this process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from factories import load_script, script_error

pytestmark = pytest.mark.script
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "dev" / "kernel_sass.py"


def _bins_present() -> bool:
    try:
        import triton
    except ImportError:  # pragma: no cover
        return False
    b = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return (b / "nvdisasm").is_file() and (b / "cuobjdump").is_file()


def _run(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.skipif(not _bins_present(), reason="this Triton install ships no nvdisasm/cuobjdump")
def test_kernel_sass_counts_the_decode_main_loop_and_the_write_kernel():
    res = _run("decode", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    d = json.loads(res.stdout)
    assert d["arch"] == "sm_90" and 0 < d["registers"] <= 255
    ml = d["main_loop"]
    # a 64-token step of one KV head: four key and four value dots of several HMMA each; the
    # per-token figure divides the loop by the step's tokens
    assert ml["opcodes"]["HMMA"] >= 32 and ml["instructions"] > 200
    assert ml["per_token"] == pytest.approx(ml["instructions"] / 64)
    assert ml["instructions"] == max(lp["instructions"] for lp in d["loops"])
    # two KV heads per program: the step covers twice the token-heads
    two = json.loads(_run("decode", "--set", "HP=2", "--json").stdout)
    assert two["main_loop"]["per_token"] == pytest.approx(two["main_loop"]["instructions"] / 128)
    # the logit-noise correction compiles for the GPU (the interpreter does not type-check the
    # kernel as the compiler does) and costs instructions only where it is on
    corr = json.loads(_run("decode", "--set", "CORR=1", "--json").stdout)
    assert corr["main_loop"]["instructions"] > ml["instructions"]
    w = json.loads(_run("write", "--json").stdout)
    assert w["loops"] and "main_loop" not in w and w["instructions"] > 500


def test_kernel_sass_refuses_an_unknown_constexpr_in_one_line():
    msg = script_error(load_script("dev/kernel_sass.py").main, ["decode", "--set", "NOPE=1"])
    assert msg.startswith("error: --set 'NOPE=1': expected NAME=VALUE with NAME one of [")
