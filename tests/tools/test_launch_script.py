"""launch.sh (written by `oscar export`): one line and exit 1 when the interpreter lacks the OSCAR
SGLang fork or the prefill backend does not suit the GPU; otherwise it starts the fork's server
with its flags. Run under bash with a fake PATH: a `python` without site-packages, fake `sglang`
packages on PYTHONPATH, a fake `nvidia-smi`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from oscar_calib.tools.export.sglang.export import (
    ENV_FILE,
    FORK_INSTALL,
    FORK_MARKER,
    LAUNCH_FILE,
    ServeSettings,
    launch_script,
)

# a launch_server that reports what it was given instead of serving
FAKE_SERVER = """import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "env": {k: v for k, v in os.environ.items() if k.startswith("SGLANG_")}}))
"""


@pytest.fixture
def serve_dir(tmp_path) -> Path:
    d = tmp_path / "serve"
    d.mkdir()
    s = ServeSettings("fork-main", "/models/my model", 64, 64, 256, 0.95, 0.9, absorb_v=False, v_identity=False)
    (d / LAUNCH_FILE).write_text(launch_script(s, "k_rotation_x.pt", "v_rotation_x.pt"))
    (d / ENV_FILE).write_text("SGLANG_ENABLE_MIXED_KV_WINDOWS=1\nSGLANG_OSCAR_K_CLIP_RATIO=0.95\n")
    return d


def fake_bin(tmp_path: Path, gpu: str | None = None) -> Path:
    """A PATH folder: `python` (this interpreter without site-packages) and maybe `nvidia-smi`."""
    b = tmp_path / "bin"
    b.mkdir(exist_ok=True)
    (b / "python").write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    (b / "python").chmod(0o755)
    if gpu is not None:
        (b / "nvidia-smi").write_text(f"#!/bin/sh\necho {gpu}\n")
        (b / "nvidia-smi").chmod(0o755)
    return b


def sglang_package(root: Path, *, fork: bool) -> Path:
    pkg = root / "sglang"
    (pkg / "srt").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "srt" / "__init__.py").write_text("")
    (pkg / "srt" / "environ.py").write_text(f"{FORK_MARKER} = False\n" if fork else "SGLANG_PORT = 30000\n")
    (pkg / "launch_server.py").write_text(FAKE_SERVER)
    return root


def launch(serve_dir: Path, tmp_path: Path, *, pythonpath: Path | None = None, gpu: str | None = None,
           **env) -> subprocess.CompletedProcess:
    base = {"PATH": f"{fake_bin(tmp_path, gpu)}:/usr/bin:/bin", "HOME": str(tmp_path),
            "PYTHONPATH": str(pythonpath or tmp_path / "empty")}
    return subprocess.run(["bash", str(serve_dir / LAUNCH_FILE), "--port", "30001"], capture_output=True, text=True,
                          env={**base, **env}, timeout=60)


def test_the_script_says_how_to_install_the_fork_and_what_fa3_needs(serve_dir):
    text = (serve_dir / LAUNCH_FILE).read_text()
    assert FORK_INSTALL in text and "pip install -e OSCAR/sglang-research/python" in FORK_INSTALL
    assert "sm80-sm90" in text and "PREFILL_BACKEND=triton" in text
    assert "MODEL_PATH='/models/my model'" in text           # a path with a space stays one word


def test_no_sglang_is_one_line_and_exit_1(serve_dir, tmp_path):
    r = launch(serve_dir, tmp_path)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines() == [f"launch.sh: python has no sglang; install the OSCAR fork: {FORK_INSTALL}"]


def test_a_stock_sglang_is_refused(serve_dir, tmp_path):
    r = launch(serve_dir, tmp_path, pythonpath=sglang_package(tmp_path / "stock", fork=False))
    assert r.returncode == 1
    assert r.stderr.splitlines() == [f"launch.sh: the sglang of python is not the OSCAR fork; install it: {FORK_INSTALL}"]


def test_an_interpreter_that_cannot_run(serve_dir, tmp_path):
    r = launch(serve_dir, tmp_path, PYTHON=str(tmp_path / "no-such-python"))
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1 and "cannot run" in r.stderr


def test_the_fork_starts_with_its_flags_and_settings(serve_dir, tmp_path):
    r = launch(serve_dir, tmp_path, pythonpath=sglang_package(tmp_path / "fork", fork=True), gpu="9.0")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    argv = got["argv"]
    assert argv[argv.index("--model-path") + 1] == "/models/my model"
    assert argv[argv.index("--prefill-attention-backend") + 1] == "fa3" and argv[-2:] == ["--port", "30001"]
    assert " ".join(argv).count("--kv-cache-dtype int2") == 1
    assert got["env"]["SGLANG_OSCAR_K_ROTATION_PATH"] == str(serve_dir.resolve() / "k_rotation_x.pt")
    assert got["env"]["SGLANG_ENABLE_MIXED_KV_WINDOWS"] == "1"


@pytest.mark.parametrize("gpu,backend,ok", [("10.0", "fa3", False), ("10.0", "triton", True), ("8.0", "fa3", True),
                                            (None, "fa3", True), ("9.0", "flashinfer", False)])
def test_the_prefill_backend_must_suit_the_gpu(serve_dir, tmp_path, gpu, backend, ok):
    r = launch(serve_dir, tmp_path, pythonpath=sglang_package(tmp_path / "fork", fork=True), gpu=gpu,
               PREFILL_BACKEND=backend)
    assert (r.returncode == 0) is ok, r.stderr
    if not ok:
        assert len(r.stderr.splitlines()) == 1 and r.stdout == ""
        assert ("PREFILL_BACKEND=triton" if backend == "fa3" else "takes fa3 or triton") in r.stderr
    else:
        argv = json.loads(r.stdout)["argv"]
        assert argv[argv.index("--prefill-attention-backend") + 1] == backend



def test_upstream_target_takes_any_sglang_and_names_its_pull_request(tmp_path):
    """The upstream target's launch.sh (``fork=False``) starts a stock sglang (its build with the pull
    request is not recognisable from its files) and, without sglang, names the pull request."""
    from oscar_calib.tools.export.sglang.export import UPSTREAM_PR

    d = tmp_path / "up"
    d.mkdir()
    s = ServeSettings("sglang", "/models/m", 64, 64, 256, 0.95, 0.9, absorb_v=False, v_identity=False)
    (d / LAUNCH_FILE).write_text(launch_script(s, "k.pt", "v.pt", fork=False))
    (d / ENV_FILE).write_text("SGLANG_OSCAR_K_CLIP_RATIO=0.95\n")
    assert FORK_INSTALL not in (d / LAUNCH_FILE).read_text()
    r = launch(d, tmp_path)
    assert r.returncode == 1 and r.stderr.splitlines() == [
        f"launch.sh: python has no sglang; install an sglang built with {UPSTREAM_PR}"]
    r = launch(d, tmp_path, pythonpath=sglang_package(tmp_path / "stock", fork=False), gpu="9.0")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["argv"][:2] == ["--model-path", "/models/m"]
