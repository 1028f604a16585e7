"""Liveness of the ranks of a data-parallel job, so that survivors of a dead rank stop in bounded time.

A rank killed on another machine (SIGKILL, OOM killer, a lost node) is noticed by its own node's
launcher, but not by the other nodes: their ranks would go on computing their share of the
batches, possibly for hours, and only fail at the next collective. So every rank runs a daemon
thread that keeps a heartbeat in the job's own key-value store (the ``TCPStore`` at
``MASTER_ADDR:MASTER_PORT`` that torchrun, accelerate and ``oscar calibrate --nproc`` already run
for the rendezvous; nothing home-made), watches its neighbours and a shared ``stop`` key:

==========================  ======================================================================
key (under a per-job prefix)  meaning
==========================  ======================================================================
``beat/{r}``                a counter rank ``r`` bumps every ``interval`` seconds; ``+DONE`` once
                            it has finished
``stop``                    the first reason to stop the job, e.g. ``rank 3 stopped responding``
                            or ``rank 1 failed (DataError: ...)``; set once, read by every rank
``door/{r}``                ``HOST:PORT`` of a socket rank ``r`` listens on and never reads: while
                            its process lives the kernel accepts a connection, once it is dead the
                            connection is refused
==========================  ======================================================================

Rank ``r`` watches ranks ``r+1`` and ``r+2`` (mod world): a neighbour whose counter has not moved
for ``timeout`` seconds (``OSCAR_DIST_HEARTBEAT``, default 60; ``0`` turns the watch off) is
declared dead under ``stop``. Every rank checks ``stop`` at every beat; when it is set (or the
store itself is gone for ``timeout``), the watcher interrupts the main thread with the reason
(a :class:`~oscar_calib.errors.DistributedError` raised by the rank's SIGTERM handler), and if the
main thread is stuck in native code it ends the process after another ``timeout`` seconds. A rank
that fails on its own publishes why, so the others stop at once instead of at their next collective;
so does a rank stopped because of another one whose fate it knows (its launcher stopped it after a
rank of its machine died, and the dead rank's door is closed): the ranks of the other machines then
name the rank that died, not the one their watch saw fall silent after it.
Each rank does four store operations per interval, whatever the world size.

The heartbeat needs a few intervals to be sure; a launcher may be faster (torchrun stops the
survivors of a machine whose agent lost the store, i.e. when the dead rank's machine hosted it).
Whenever a rank is stopped or a collective fails before the heartbeat knows why, the rank knocks on
its neighbours' doors (:meth:`Heartbeat.gone`): a refused connection names the dead rank at once.
"""

from __future__ import annotations

import contextlib
import datetime
import encodings.idna  # noqa: F401 - see below
import itertools
import os
import signal
import socket
import sys
import threading
import time

from .env import STOPPED_EXIT, env_seconds

# (encodings.idna: socket's name lookup imports this codec on first use, which can be while a peer
# has just died and the launcher is stopping this rank; the import then failed, "unknown encoding:
# idna", and the rank printed a traceback instead of its one line: seen under load in
# tests/calibration/test_distributed.py)

DEFAULT_TIMEOUT_S = 60.0
DONE = 1 << 40
WATCHED = 2          # neighbours each rank watches
_SESSIONS = itertools.count()     # calibrations in this process: a job may run several, one after the other


def heartbeat_timeout() -> float:
    """``OSCAR_DIST_HEARTBEAT`` seconds (default 60; 0: no heartbeat)."""
    return env_seconds("OSCAR_DIST_HEARTBEAT", DEFAULT_TIMEOUT_S, zero_means="off")


def job_store(timeout_s: float):
    """A client of the job's TCPStore (``MASTER_ADDR:MASTER_PORT``) under a per-attempt prefix, or
    None when the job has no such store (a process group initialised another way)."""
    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not (port or "").isdigit():
        return None
    store = dist.TCPStore(addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return dist.PrefixStore(f"oscar-heartbeat/{run}/{next(_SESSIONS)}/", store)   # every rank counts alike


def _reachable_ip() -> str:
    """This machine's address on the route to the job's store (what the other machines reach)."""
    host = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, int(os.environ.get("MASTER_PORT") or 1)))      # UDP: no packet is sent
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


class Doors:
    """A socket this rank listens on and never reads, published as ``door/{rank}``, and the doors
    of the neighbours it watches: knocking tells a dead process (refused) from a live one at once."""

    def __init__(self, store, rank: int, watched: list[int]):
        self.store, self.rank, self.watched = store, rank, watched
        self.known: dict[int, tuple[str, int]] = {}     # watched rank -> (host, port), until it finishes
        self.finished: set[int] = set()
        self._sock = socket.socket()
        self._sock.bind(("", 0))
        self._sock.listen(64)

    def publish(self) -> None:
        self.store.set(f"door/{self.rank}", f"{_reachable_ip()}:{self._sock.getsockname()[1]}")

    def learn(self) -> None:
        """Read the doors of neighbours that have published theirs since the last call."""
        for p in self.watched:
            if p not in self.known and p not in self.finished and self.store.check([f"door/{p}"]):
                host, _, port = self.store.get(f"door/{p}").decode().rpartition(":")
                self.known[p] = (host, int(port))

    def knock(self) -> str | None:
        """The line naming the watched ranks whose process is gone (connection refused, or no answer
        in 2 s), or None when all answer (or none can be asked)."""
        try:
            self.learn()
        except Exception:  # noqa: BLE001 - the store is gone: knock on the doors already known
            pass
        doors = {p: d for p, d in dict(self.known).items() if p not in self.finished}   # a copy: the thread adds
        dead = []
        for p, (host, port) in sorted(doors.items()):
            try:
                socket.create_connection((host, port), timeout=2).close()
            except OSError:
                dead.append(p)
        if not dead:
            return None
        who = ", ".join(f"rank {p} ({doors[p][0]}:{doors[p][1]})" for p in dead)
        return f"{who} is gone: its process no longer answers; it died or its machine is unreachable"

    def close(self) -> None:
        self._sock.close()


class Heartbeat:
    """This rank's heartbeat thread (see the module docstring). ``start``, then ``finish`` (clean
    exit) or ``fail`` (this rank's own error) when the rank leaves its job; ``gone`` names dead
    neighbours on demand."""

    def __init__(self, store, rank: int, world: int, timeout: float):
        self.store, self.rank, self.world, self.timeout = store, rank, world, timeout
        self.interval = max(min(timeout / 6, 5.0), 0.05)
        self.reason: str | None = None
        self._tripped, self._closed = threading.Event(), threading.Event()
        self._lock = threading.Lock()        # closing and interrupting the main thread exclude each other
        self._main_waiting = False
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=_watch, args=(self,), name=f"oscar-heartbeat-{rank}", daemon=True)
        self._watched = sorted({(rank + i) % world for i in range(1, WATCHED + 1)} - {rank})
        self.doors = Doors(store, rank, self._watched)

    def start(self) -> "Heartbeat":
        self.doors.publish()
        self.store.add(f"beat/{self.rank}", 1)
        self._thread.start()
        return self

    def gone(self) -> str | None:
        """Knock on the watched neighbours' doors now (:meth:`Doors.knock`)."""
        return self.doors.knock()

    def told(self) -> str | None:
        """The reason to stop that a rank has already given under ``stop`` (None: none yet, or the store
        is gone), read now rather than at the watch's next beat."""
        try:
            return self.store.get("stop").decode() or None if self.store.check(["stop"]) else None
        except Exception:  # noqa: BLE001 - the store went away with its launcher
            return None

    def why(self) -> str | None:
        """Why this rank is being stopped, as far as it can tell at once: the watch's reason, the one
        another rank gave, or a watched neighbour whose process is gone."""
        return self.reason or self.told() or self.gone()

    def finish(self) -> None:
        """This rank is done: its neighbours stop watching it."""
        self.close()
        with contextlib.suppress(Exception):      # the store may be gone with the launcher: nothing to tell
            self.store.add(f"beat/{self.rank}", DONE)

    def fail(self, why: str) -> None:
        """This rank failed on its own: every other rank stops now, with ``why``."""
        self.close()
        self.tell(f"rank {self.rank} failed ({why})")

    def tell(self, reason: str) -> None:
        """Every rank stops, with ``reason``, unless a reason was already given. A rank stopped because
        of another (its launcher's SIGTERM after a local rank died, a neighbour's closed door) says
        so: otherwise the ranks of other machines would only see this rank fall silent and name it."""
        with contextlib.suppress(Exception):      # the store may be gone with its launcher
            self.store.compare_set("stop", "", reason)

    def close(self) -> None:
        """Stop the thread; after this it never interrupts the main thread."""
        with self._lock:
            self._closed.set()
        self.doors.close()

    def await_reason(self) -> str | None:
        """Called by the main thread when a collective failed: a neighbour whose process is gone,
        else wait (at most ``2 * timeout``) until the watch can name why; None if it cannot."""
        self._main_waiting = True
        if self.reason is None and (now := self.told() or self.gone()):
            return now
        self._tripped.wait(2 * self.timeout + 2 * self.interval)
        return self.reason

    def _trip(self, reason: str) -> None:
        self.reason = reason
        self._tripped.set()
        with self._lock:
            if self._closed.is_set():
                return
            if not self._main_waiting:
                signal.pthread_kill(self._main, signal.SIGTERM)   # the rank's handler raises with the reason
        if not self._closed.wait(self.timeout + 5):               # stuck in native code: end the process
            sys.stderr.write(f"error: rank {self.rank}: {reason}; the rank did not stop within "
                             f"{self.timeout + 5:g} s and was ended; checkpoints are kept, rerun with --resume\n")
            sys.stderr.flush()
            os._exit(STOPPED_EXIT)


def _watch(hb: Heartbeat) -> None:
    """The heartbeat thread: beat, read ``stop``, watch the neighbours, until closed or tripped."""
    seen = {p: (-1, time.monotonic()) for p in hb._watched}
    lost_since = None
    while not hb._closed.wait(hb.interval):
        try:
            reason = _check(hb, seen)
            lost_since = None
        except Exception:  # noqa: BLE001 - the store went away (its host stopped)
            if hb._closed.is_set():
                return
            lost_since = lost_since or time.monotonic()
            reason = None
            if time.monotonic() - lost_since > hb.timeout:
                host = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
                reason = hb.gone() or f"lost contact with the job's store at {host} (its launcher stopped)"
        if reason:
            return hb._trip(reason)


def _check(hb: Heartbeat, seen: dict) -> str | None:
    """One beat; the reason to stop, if there is one."""
    store = hb.store
    store.add(f"beat/{hb.rank}", 1)
    if store.check(["stop"]) and (reason := store.get("stop").decode()):
        return reason
    hb.doors.learn()
    now = time.monotonic()
    silent = []
    for p, (count, since) in seen.items():
        v = store.add(f"beat/{p}", 0)
        if v >= DONE:
            hb.doors.finished.add(p)          # a finished rank's door closes: not a death
            continue
        if v != count:
            seen[p] = (v, now)
        elif now - since > hb.timeout:
            silent.append((since, p))
    if not silent:
        return None
    # the neighbour silent the longest (all of them when the beats cannot tell them apart)
    first = min(since for since, _ in silent)
    who = sorted(p for since, p in silent if since == first)
    names = f"rank {who[0]}" if len(who) == 1 else f"ranks {', '.join(map(str, who))}"
    reason = (f"{names} stopped responding (no heartbeat for {hb.timeout:g} s): {'it' if len(who) == 1 else 'they'} "
              f"died or {'its machine is' if len(who) == 1 else 'their machines are'} unreachable")
    store.compare_set("stop", "", reason)
    return store.get("stop").decode() or reason
