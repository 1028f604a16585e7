#!/usr/bin/env python
"""One entry point for the benchmarks under ``scripts/bench/``.

    python scripts/bench/run.py list                      # the benchmarks and their current results
    python scripts/bench/run.py kernels --quick           # run one: the arguments go to bench_kernels.py
    python scripts/bench/run.py accept bench_out/kernels-h100.json   # install a result fetched from a GPU machine
    python scripts/bench/run.py report [--check]          # render docs/benchmarks.md from the current results

A benchmark NAME runs ``bench_NAME.py``'s ``main`` with the remaining arguments (``NAME --help``
shows them). ``accept`` checks each file's header and installs it as
``scripts/bench/results/{benchmark}-{device}.json`` (sections the run did not measure are kept
from the file it replaces), then re-renders the page.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # imported rather than run (the tests)
    sys.path.append(str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    BENCHMARKS,
    RESULTS,
    check_result,
    install_result,
    load_results,
    run_program,
)

USAGE = f"usage: run.py {{list,accept,report,{','.join(BENCHMARKS)}}} [ARGS]"


def accept(paths: list[str]) -> int:
    """Install each result file as the current one for its benchmark and device; re-render the page."""
    if not paths:
        raise SystemExit("error: accept needs one or more result files")
    docs = []
    for p in paths:
        try:
            docs.append(check_result(json.loads(Path(p).read_text()), p))
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: {p}: {e}") from None
    for doc in docs:
        try:
            print(f"current result: {install_result(doc)}")
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    import report

    return report.main([])


def list_results() -> int:
    have = {}
    for doc in load_results():
        have.setdefault(doc["benchmark"], []).append(f"{doc['device']} ({doc['commit']}, {doc['date'][:10]})")
    for b in BENCHMARKS:
        print(f"{b:<10} scripts/bench/bench_{b}.py  current: {', '.join(have.get(b, [])) or 'none'}")
    print(f"results: {RESULTS}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + __doc__.strip())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "list":
        return list_results()
    if cmd == "accept":
        return accept(rest)
    if cmd == "report":
        import report

        return report.main(rest)
    if cmd not in BENCHMARKS:
        raise SystemExit(f"error: no benchmark {cmd!r}; one of: list, accept, report, {', '.join(BENCHMARKS)}")
    rc = importlib.import_module(f"bench_{cmd}").main(rest)
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    run_program(main)
