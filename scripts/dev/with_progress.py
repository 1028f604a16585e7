"""Run a command and never leave the terminal silent for long: its output passes through, and
while it prints nothing a line says that it is still running and for how long.

    python scripts/dev/with_progress.py "installing torch" -- python -m pip install -q torch==2.13.0

``make setup`` runs each pip install through it (``pip -q`` prints nothing for a minute while a big
wheel downloads and unpacks). The first line comes at once, then one at most every ``--every``
seconds (10) while the command is quiet, and a last one with the time it took. Exit code: the
command's. Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import threading
import time


def run(label: str, argv: list[str], every: float = 10.0, out=sys.stdout) -> int:
    start = last = time.monotonic()
    lock = threading.Lock()

    def say(text: str) -> None:
        out.write(f"{label}: {text}\n")
        out.flush()

    say(f"{shlex.join(argv)} …")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    done = threading.Event()

    def tick() -> None:
        nonlocal last
        while not done.wait(0.5):
            with lock:
                now = time.monotonic()
                if now - last >= every:
                    last = now
                    say(f"still running, {now - start:.0f} s")

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    for line in proc.stdout:
        with lock:
            last = time.monotonic()
            out.write(line)
            out.flush()
    code = proc.wait()
    done.set()
    ticker.join()
    say(f"{'done' if code == 0 else f'failed (exit {code})'} in {time.monotonic() - start:.0f} s")
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 usage="%(prog)s LABEL [--every S] -- COMMAND [ARG ...]")
    ap.add_argument("label", help="what the command does, the start of every line this prints")
    ap.add_argument("--every", type=float, default=10.0, help="seconds of silence between two lines (10)")
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        ap.error("give the command after --")
    cut = argv.index("--")
    args = ap.parse_args(argv[:cut])
    return run(args.label, argv[cut + 1:], args.every)


if __name__ == "__main__":
    sys.exit(main())
