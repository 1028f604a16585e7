"""Several machines through the standard launcher: two torchrun "nodes" on this host (CPU, gloo,
a c10d rendezvous on localhost, one rank each), as on a cluster whose machines share the output
directory; a rank killed mid-capture on one of them; and the heartbeat that stops the survivors.

Every rank runs the real CLI (tests/fault_worker.py wraps it to inject slow batches and a SIGKILL).
The single-process reference runs in this process with one thread, as the ranks do
(OMP_NUM_THREADS=1), so activations are bit-identical and only the order of the float64 additions
differs (each rank sums its own batches, then one all-reduce): those sums agree to ~1e-16
relative, and on this model that difference disappears in the float32 artifact, which is compared
byte for byte.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from factories import TESTS

from oscar_calib.calibration.pipeline import calibrate
from oscar_calib.contract.config import CalibrationConfig
from oscar_calib.jobs.heartbeat import DONE, Heartbeat

WORKER = TESTS / "fault_worker.py"
# 16 sequences of 64 tokens, one per batch: 8 batches per rank, a checkpoint after every batch
SETTINGS = dict(tokens=1024, seq_len=64, batch_size=1, heldout_tokens=48, checkpoint_every=1, device="cpu")
ARGS = ["--tokens", "1024", "--seq-len", "64", "--batch-size", "1", "--heldout-tokens", "48",
        "--checkpoint-every", "1", "--device", "cpu", "--no-verify"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_dir) -> bytes:
    """oscar.safetensors of a single-process run over the same tokens, one thread."""
    out = tmp_path_factory.mktemp("ref") / "out"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        calibrate(CalibrationConfig(model=str(tiny_dir), **SETTINGS), out)
    finally:
        torch.set_num_threads(threads)
    return (out / "oscar.safetensors").read_bytes()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(tiny_dir: Path, out: Path, logs: Path, *extra: str, env: dict | None = None, per_node: int = 1) -> list:
    """Two torchrun processes, --nnodes 2 --node-rank 0/1, meeting at a c10d rendezvous on localhost,
    each starting ``per_node`` ranks."""
    port = free_port()
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]), "OMP_NUM_THREADS": "1",
            "OSCAR_DIST_HEARTBEAT": "2", **(env or {})}
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", f"oscar-test-{port}", "--monitor-interval", "0.1", str(WORKER),
               "calibrate", str(tiny_dir), "--out", str(out), *ARGS, *extra]
        log = open(logs / f"node{node}.log", "w")
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full), log))
    return procs


def wait_all(procs, timeout: float = 300) -> list[tuple[int, float]]:
    """(exit code, time it exited) per node."""
    ends = [None, None]
    t0 = time.time()
    while None in ends:
        for i, (p, _) in enumerate(procs):
            if ends[i] is None and p.poll() is not None:
                ends[i] = (p.returncode, time.time())
        if time.time() - t0 > timeout:
            for p, _ in procs:
                p.kill()
            pytest.fail("the nodes did not finish in time")
        time.sleep(0.05)
    for _, log in procs:
        log.close()
    return ends


@pytest.mark.slow
def test_two_nodes_equal_one_process_bit_for_bit(tmp_path, tiny_dir, reference):
    import json

    out = tmp_path / "out"
    ends = wait_all(start_nodes(tiny_dir, out, tmp_path))
    logs = [(tmp_path / f"node{i}.log").read_text() for i in (0, 1)]
    assert [c for c, _ in ends] == [0, 0], logs
    assert (out / "oscar.safetensors").read_bytes() == reference
    timings = json.loads((out / "calibration.json").read_text())["timings"]
    assert timings["world_size"] == 2 and timings["rank_batches"] == 8
    assert not list(out.glob(".oscar-checkpoint*")) and not list(out.glob(".*.tmp"))


@pytest.mark.slow
def test_a_rank_killed_on_one_node_stops_the_other_and_resume_finishes(tmp_path, tiny_dir, reference):
    """Rank 1 is SIGKILLed after its 3rd batch; rank 0 (the other node) is then slowed to 6 s a
    batch, so it would need ~30 s more to reach its next collective (the all-reduce after its 8
    batches): it is stopped in its own batches, before that collective (the heartbeat, 2 s here, or
    torchrun when rank 1's machine hosted the store), with one line naming rank 1. The checkpoints
    stay; --resume finishes to the same artifact."""
    out, mark, ends_dir = tmp_path / "out", tmp_path / "died", tmp_path / "ends"
    ends_dir.mkdir()
    faults = {"OSCAR_TEST_DIE_RANK": "1", "OSCAR_TEST_DIE_AT": "3", "OSCAR_TEST_MARK": str(mark),
              "OSCAR_TEST_SLOW": "6", "OSCAR_TEST_SLOW_FROM": "3", "OSCAR_TEST_SLOW_RANKS": "0",
              "OSCAR_TEST_ENDS": str(ends_dir)}
    ends = wait_all(start_nodes(tiny_dir, out, tmp_path, env=faults))
    logs = [(tmp_path / f"node{i}.log").read_text() for i in (0, 1)]
    survivor = next(i for i in (0, 1) if "rank 0:" in logs[i])
    assert ends[0][0] != 0 and ends[1][0] != 0, logs
    assert mark.exists()                                         # rank 1 died where it was told to
    # stopped in its own batches: it never reached the collective its remaining ~30 s lead to
    assert int((ends_dir / "forwards.rank0").read_text()) < 8, logs
    errors = [line for line in logs[survivor].splitlines() if line.startswith("error:")]
    # named by the heartbeat, or (when rank 1's machine hosted the store and torchrun stopped rank 0
    # first) by knocking on rank 1's door
    assert len(errors) == 1 and re.match(r"error: rank 0: stopped: rank 1 (stopped responding|\(.*\) is gone)",
                                         errors[0]), logs
    # torchrun prints its own report (with its traceback) of the failed worker; ours is the one line
    assert "--resume" in errors[0] and not re.search(r'File ".*oscar_calib', logs[survivor])
    for r in (0, 1):                                             # the last checkpoint of each rank is intact
        state = torch.load(out / f".oscar-checkpoint.rank{r}-of-2.pt", weights_only=True)
        assert state["batches_done"] >= 2                       # saved after batch 2, before the kill
    assert not (out / "oscar.safetensors").exists()
    ends = wait_all(start_nodes(tiny_dir, out, tmp_path, "--resume"))
    assert [c for c, _ in ends] == [0, 0], [(tmp_path / f"node{i}.log").read_text() for i in (0, 1)]
    assert (out / "oscar.safetensors").read_bytes() == reference


@pytest.mark.slow
def test_the_other_machine_names_the_rank_that_died_not_the_one_its_launcher_stopped(tmp_path, tiny_dir):
    """2 machines x 2 ranks; rank 3 is SIGKILLed, the others are slowed. Its own machine's launcher
    stops rank 2 at once; rank 2 finds rank 3's door closed and says so in the job's store, so ranks
    0 and 1 on the other machine name rank 3 (before, their watch saw rank 2 fall silent after rank 3
    and named rank 2, which had died of nothing)."""
    out, mark, ends = tmp_path / "out", tmp_path / "died", tmp_path / "ends"
    ends.mkdir()
    faults = {"OSCAR_TEST_DIE_RANK": "3", "OSCAR_TEST_DIE_AT": "2", "OSCAR_TEST_MARK": str(mark),
              "OSCAR_TEST_SLOW": "4", "OSCAR_TEST_SLOW_FROM": "2", "OSCAR_TEST_SLOW_RANKS": "0,1,2",
              "OSCAR_TEST_ENDS": str(ends), "OSCAR_DIST_HEARTBEAT": "6"}
    wait_all(start_nodes(tiny_dir, out, tmp_path, env=faults, per_node=2))
    text = "\n".join((tmp_path / f"node{i}.log").read_text() for i in (0, 1))
    lines = {int(m.group(1)): m.group(0) for m in re.finditer(r"^error: rank (\d): .*$", text, re.MULTILINE)}
    assert sorted(lines) == [0, 1, 2], text
    for r in (0, 1, 2):
        assert re.match(rf"error: rank {r}: stopped: rank 3 \(.*\) is gone", lines[r]), lines
    # told, not timed out: rank 0 does not watch rank 3 (it watches 1 and 2), so it can name rank 3
    # only from the reason rank 2 gave; every survivor exited on its own, in its own batches
    assert mark.exists() and "stopped responding" not in text, text
    forwards = {f.name: int(f.read_text()) for f in ends.glob("forwards.rank*")}
    assert forwards.keys() == {"forwards.rank0", "forwards.rank1", "forwards.rank2"}, forwards
    assert all(n < 4 for n in forwards.values()), forwards          # 4 batches each: before the all-reduce


# ----------------------------------------------------------------------------- the heartbeat alone

@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield dist.PrefixStore(f"t{time.monotonic_ns()}/", server)


@pytest.fixture
def sigterm():
    """SIGTERMs the heartbeat sends to this (main) thread, recorded instead of acted on."""
    got = []
    old = signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    yield got
    signal.signal(signal.SIGTERM, old)


def wait_for(cond, limit: float = 10.0) -> bool:
    t0 = time.time()
    while not cond() and time.time() - t0 < limit:
        time.sleep(0.02)
    return cond()


def test_heartbeat_names_a_silent_rank_and_stops_this_one(store, sigterm):
    hb = Heartbeat(store, rank=0, world=3, timeout=0.5).start()
    stop = threading.Event()

    def rank2():                       # alive: bumps its counter; rank 1 never does
        while not stop.wait(0.05):
            store.add("beat/2", 1)

    threading.Thread(target=rank2, daemon=True).start()
    try:
        assert wait_for(lambda: hb.reason is not None)
        assert hb.reason.startswith("rank 1 stopped responding (no heartbeat for 0.5 s)")
        assert wait_for(lambda: sigterm == [signal.SIGTERM])       # the main thread is interrupted
        assert store.get("stop").decode() == hb.reason             # and every other rank will read it
    finally:
        stop.set()
        hb.close()


def beats(store, rank: int) -> int:
    return store.add(f"beat/{rank}", 0) % DONE


def test_heartbeat_passes_on_a_failure_and_ignores_finished_ranks(store, sigterm):
    r0, r1 = Heartbeat(store, 0, 2, 0.5).start(), Heartbeat(store, 1, 2, 0.5).start()
    # one beat every timeout / 6: 15 beats of a watch span more than two of its timeouts
    try:
        assert wait_for(lambda: min(beats(store, 0), beats(store, 1)) >= 15, 30)  # both alive: nothing happens
        assert r0.reason is None and r1.reason is None and not sigterm
        r1.finish()
        assert store.add("beat/1", 0) >= DONE
        seen = beats(store, 0)
        assert wait_for(lambda: beats(store, 0) >= seen + 15, 30)  # a finished rank is not a dead one
        assert r0.reason is None and not sigterm
    finally:
        r0.close()
    fresh = dist.PrefixStore("again/", store)
    a, b = Heartbeat(fresh, 0, 2, 5.0).start(), Heartbeat(fresh, 1, 2, 5.0).start()
    try:
        b.fail("DataError: no text in the data")
        assert wait_for(lambda: a.reason is not None, 15)
        assert a.reason == "rank 1 failed (DataError: no text in the data)"
    finally:
        a.close()
        b.close()


def test_a_rank_that_knows_why_it_stopped_tells_the_others(store, sigterm):
    r0, r1 = Heartbeat(store, 0, 2, 5.0).start(), Heartbeat(store, 1, 2, 5.0).start()
    try:
        r1.tell("rank 2 (10.0.0.7:4000) is gone: its process no longer answers")
        assert wait_for(lambda: r0.reason is not None, 15)
        assert r0.reason == "rank 2 (10.0.0.7:4000) is gone: its process no longer answers"
        assert r1.told() == r0.reason and r1.why() == r0.reason    # read at once, not at the next beat
        r1.tell("a later reason")                              # the first reason stays
        assert store.get("stop").decode() == r0.reason
    finally:
        r0.close()
        r1.close()


def test_neighbours_silent_since_the_same_beat_are_all_named(store, sigterm):
    """Ranks 1 and 2 fall silent within one beat of rank 0's watch: it cannot tell which went
    first, and names both instead of whichever it happens to check first."""
    hb = Heartbeat(store, rank=0, world=3, timeout=0.6)
    store.add("beat/1", 1)
    store.add("beat/2", 1)
    hb.start()
    try:
        assert wait_for(lambda: hb.reason is not None)
        assert hb.reason.startswith("ranks 1, 2 stopped responding (no heartbeat for 0.6 s): they died")
    finally:
        hb.close()


# ----------------------------------------------------------------------------- devices on the second machine

def test_devices_come_from_the_local_rank_on_every_machine(monkeypatch):
    """Rank 3 of 2 machines × 2 ranks is local rank 1 of machine 1: it takes that machine's second
    GPU, or with a device map its GPUs 4..7 of 8, never anything derived from the global rank."""
    from oscar_calib.jobs.session import DistContext, placement_for_rank, rank_device
    from oscar_calib.model.placement import Placement

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda g: (70 * 2**30, 80 * 2**30))
    for k, v in dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", GROUP_RANK="1").items():
        monkeypatch.setenv(k, v)
    assert rank_device("cuda", 1, None, 2) == ("nccl", "cuda:1")
    assert rank_device("cuda", 1, Placement("auto"), 2) == ("nccl", "cuda:4")
    ctx = DistContext(rank=3, world_size=4, local_rank=1, local_world_size=2, device="cuda:4", backend="nccl")
    got = placement_for_rank(Placement("auto", {"cpu": "100GiB"}), ctx)
    assert sorted(k for k in got.max_memory if isinstance(k, int)) == [4, 5, 6, 7]
    assert got.max_memory["cpu"] == "100GiB" and got.max_memory[4] == int(70 * 2**30 * 0.9)
