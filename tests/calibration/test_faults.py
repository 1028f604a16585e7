"""Faults of a single process and the rest of the bad-input list: a full disk while
writing the artifact or a checkpoint, SIGKILL while writing, Ctrl-C, damaged model weights, binary
data, settings the run can go on with (one warning line each), a typo in ``--zoo``.

A full disk is simulated by an ``os.write`` that writes half of what it is given and then fails
with ENOSPC, as a filling disk does, for the files named (everything else is written normally);
where this host lets the test mount a tmpfs, a real full file system as well.
"""

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from factories import (
    FAST_ARGS,
    TESTS,
    assert_one_line_error,
    calibrate_tiny,
    oscar,
)

from oscar_calib.tools.validate import validate_artifact

# Fault injection (full disks, SIGKILL, Ctrl-C, damaged inputs): the slow tier.
pytestmark = pytest.mark.slow

ARTIFACT_FILES = ["README.md", "calibration.json", "oscar.safetensors"]


def calibrate_cli(model, out, *extra):
    return oscar("calibrate", str(model), "--out", str(out), *FAST_ARGS, *extra)


@contextlib.contextmanager
def full_disk(monkeypatch, under: Path, name: str, after: int = 0):
    """``os.write`` to a file under ``under`` whose name contains ``name`` writes half of its bytes
    and fails with ENOSPC (the first ``after`` such files are written normally)."""
    real, seen = os.write, []

    def write(fd, data):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        if path.startswith(str(under)) and name in os.path.basename(path):
            if path not in seen:
                seen.append(path)
            if len(seen) > after:
                real(fd, bytes(data[: len(data) // 2]))
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    with monkeypatch.context() as m:
        m.setattr(os, "write", write)
        yield


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# ----------------------------------------------------------------------------- a full disk

def test_disk_full_while_writing_the_artifact(monkeypatch, tmp_path, tiny_llama_dir):
    out = tmp_path / "art"
    assert calibrate_cli(tiny_llama_dir, out)[0] == 0
    before = snapshot(out)
    assert sorted(before) == ARTIFACT_FILES
    with full_disk(monkeypatch, tmp_path, "oscar.safetensors"):
        code, _, err = calibrate_cli(tiny_llama_dir, out, "--overwrite", "--seed", "1")
    assert_one_line_error(code, err, f"cannot write {out}: No space left on device (free some space and run again)")
    assert snapshot(out) == before                          # the old artifact, whole; no temporaries
    assert validate_artifact(out).ok
    fresh = tmp_path / "fresh"
    with full_disk(monkeypatch, tmp_path, "oscar.safetensors"):
        code, _, err = calibrate_cli(tiny_llama_dir, fresh)
    assert_one_line_error(code, err, "No space left on device")
    assert not fresh.exists()                               # no half-written directory


def test_disk_full_at_a_checkpoint_keeps_the_last_one_and_resume_finishes(monkeypatch, tmp_path,
                                                                          tiny_llama_dir):
    ref, out = tmp_path / "ref", tmp_path / "out"
    extra = ("--checkpoint-every", "1")
    assert calibrate_cli(tiny_llama_dir, ref, *extra)[0] == 0
    with full_disk(monkeypatch, out, ".oscar-checkpoint.pt", after=1):       # the 2nd checkpoint write fails
        code, _, err = calibrate_cli(tiny_llama_dir, out, *extra)
    assert_one_line_error(code, err, "No space left on device")
    assert "--resume" in err
    assert sorted(p.name for p in out.iterdir()) == [".oscar-checkpoint.pt"]
    assert torch.load(out / ".oscar-checkpoint.pt", weights_only=True)["batches_done"] == 1   # intact
    code, _, err = calibrate_cli(tiny_llama_dir, out, *extra, "--resume")
    assert code == 0, err
    assert (out / "oscar.safetensors").read_bytes() == (ref / "oscar.safetensors").read_bytes()


def test_a_really_full_tmpfs(tmp_path, tiny_llama_dir):
    """The same on a real 256 KiB tmpfs, filled to within 16 KiB (runs where the test may mount)."""
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root); the simulated full disk above covers the logic")
    try:
        with open(small / "filler", "wb") as f:
            with contextlib.suppress(OSError):
                f.write(b"x" * (256 * 1024 - 16 * 1024))
        code, _, err = calibrate_cli(tiny_llama_dir, small / "art")
        assert_one_line_error(code, err, "No space left on device")
        assert sorted(p.name for p in small.iterdir()) == ["filler"]
    finally:
        subprocess.run(["umount", str(small)], check=False)


# ----------------------------------------------------------------------------- SIGKILL while writing

KILL_WHILE_WRITING = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from factories import TINY_FAST, loaded_tiny
from oscar_calib.calibration.pipeline import calibrate
from oscar_calib.contract.config import CalibrationConfig

real = os.fsync
def fsync(fd):                     # the artifact's tensors are written, not yet renamed into place
    if os.path.basename(os.readlink(f"/proc/self/fd/{{fd}}")).startswith(".oscar.safetensors."):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(fd)
os.fsync = fsync
calibrate(CalibrationConfig(**dict(TINY_FAST, seed={seed})), {out!r}, loaded=loaded_tiny(), overwrite=True)
"""


def kill_while_writing(out: Path, seed: int) -> None:
    script = textwrap.dedent(KILL_WHILE_WRITING.format(tests=str(TESTS), seed=seed, out=str(out)))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]


def test_sigkill_while_writing_leaves_no_file_claiming_to_be_an_artifact(tmp_path, tiny_calibrated):
    fresh = tmp_path / "fresh"
    kill_while_writing(fresh, seed=0)
    assert not any((fresh / n).exists() for n in ARTIFACT_FILES)       # no card, report or tensors
    assert not validate_artifact(fresh).ok
    assert list(fresh.glob(".oscar.safetensors.*.tmp"))                 # the temporary, hidden, unfinished
    old = shutil.copytree(tiny_calibrated, tmp_path / "old")
    before = {n: (old / n).read_bytes() for n in ARTIFACT_FILES}
    kill_while_writing(old, seed=3)                                     # replacing it with --overwrite
    assert {n: (old / n).read_bytes() for n in ARTIFACT_FILES} == before
    assert validate_artifact(old).ok
    calibrate_tiny(fresh, overwrite=True)                               # starts over, cleans up
    assert not list(fresh.glob(".*.tmp")) and validate_artifact(fresh).ok


# ----------------------------------------------------------------------------- Ctrl-C and --resume

def test_ctrl_c_says_how_to_resume_and_a_rerun_never_discards_the_checkpoint(tmp_path,
                                                                            tiny_llama_dir):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]), OSCAR_TEST_SLOW="0.5",
               OSCAR_PROGRESS="off")
    proc = subprocess.Popen([sys.executable, str(TESTS / "fault_worker.py"), "calibrate", str(tiny_llama_dir),
                             "--out", str(out), *FAST_ARGS, "--checkpoint-every", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    t0 = time.time()
    while not (out / ".oscar-checkpoint.pt").exists() and time.time() - t0 < 120:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)                                     # what Ctrl-C sends
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    lines = [line for line in err.splitlines() if line.strip() and "capture" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: interrupted after batch ") and \
        f"is kept in {out}: rerun the same command with --resume" in lines[0], err
    code, _, err = calibrate_cli(tiny_llama_dir, out)
    assert_one_line_error(code, err, "holds the checkpoint of an interrupted run (.oscar-checkpoint.pt): pass "
                                     "--resume to continue it, or --overwrite to start over")
    assert (out / ".oscar-checkpoint.pt").exists()
    code, _, err = calibrate_cli(tiny_llama_dir, out, "--resume")
    assert code == 0 and "warning" not in err, err
    assert json.loads((out / "calibration.json").read_text())["timings"]["resumed"] is True


def test_settings_the_run_can_go_on_with_are_one_warning_line_each(tmp_path, tiny_llama_dir):
    """--resume without a checkpoint, --seq-len beyond the model's context (512 positions here),
    --heldout-tokens beyond one sequence."""
    out = tmp_path / "out"
    code, _, err = oscar("calibrate", str(tiny_llama_dir), "--out", str(out), "--tokens",
                         "1024", "--seq-len", "1024", "--heldout-tokens", "4096", "--device", "cpu",
                         "--no-verify", "--resume")
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 3 and "Traceback" not in err, err
    assert any(f"--resume: no checkpoint .oscar-checkpoint.pt in {out}; starting from the first batch" in w
               for w in warnings)
    assert any("--seq-len 1024 is beyond tiny-llama's context of 512 positions" in w for w in warnings)
    assert any("--heldout-tokens 4096 is more than one sequence: the held-out prefix is capped at --seq-len 1024"
               in w for w in warnings)
    assert json.loads((out / "calibration.json").read_text())["calibration"]["heldout_tokens"] == 1024


# ----------------------------------------------------------------------------- damaged inputs

@pytest.mark.parametrize("case", ["truncated_weights", "random_txt", "random_jsonl", "random_parquet"])
def test_damaged_inputs_are_one_line(tmp_path, tiny_llama_dir, case):
    model, extra = tiny_llama_dir, []
    noise = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    if case == "truncated_weights":                  # a half-finished download
        model = tmp_path / "model"
        shutil.copytree(tiny_llama_dir, model)
        weights = model / "model.safetensors"
        os.truncate(weights, weights.stat().st_size // 2)
        pattern = "model.safetensors is damaged (truncated file: tensor data needs"
    else:
        data = tmp_path / f"noise.{case.split('_')[1]}"
        data.write_bytes(noise.numpy().tobytes())
        extra = ["--data", str(data)]
        pattern = {"random_txt": "does not look like text", "random_jsonl": "does not look like text",
                   "random_parquet": "not a readable parquet file"}[case]
    code, _, err = calibrate_cli(model, tmp_path / "out", *extra)
    assert_one_line_error(code, err, pattern)
    assert not (tmp_path / "out").exists()


def test_a_zoo_that_does_not_exist_is_an_error(tmp_path):
    for cmd in (["zoo", "list"], ["zoo", "index", "--check"], ["zoo", "table"]):
        code, _, err = oscar(*cmd, "--zoo", str(tmp_path / "zooo"))
        assert_one_line_error(code, err, f"--zoo {tmp_path / 'zooo'}: no such directory")
