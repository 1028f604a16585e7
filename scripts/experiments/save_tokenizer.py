#!/usr/bin/env python
"""Save a model's tokenizer, as this machine's transformers converts it, to a folder that can travel.

    python scripts/experiments/save_tokenizer.py gemma3-270m .gpu/gemma3-270m-tokenizer

The GPU machines run transformers 5.17, which builds Gemma-3's GGUF tokenizer as a BPE without its
merges (one token per character; ``oscar`` refuses it: ``oscar_calib.model.load.check_tokenizer``).
transformers 5.23 here converts it with its 514,906 merges; the saved folder (``tokenizer.json`` and
its configuration, 31.8 MiB for Gemma-3) loads on the GPU machine with
``AutoTokenizer.from_pretrained(DIR)``, e.g. ``long_levers.py --tokenizer gemma3-270m=DIR``: loaded by
transformers 5.17 it cuts the embedded corpus into the same 112,785 ids as 5.23 does (checked on this
machine, 2026-11-29). The
tokenizer is loaded and checked the way every tool loads one (``load_tokenizer``; no weights are
read); the folder is written whole or not at all, and an existing one is never replaced.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a model alias, checkpoint directory or .gguf file")
    ap.add_argument("out", type=Path, help="the folder to write (must not exist)")
    args = ap.parse_args(argv)
    if args.out.exists():
        raise SystemExit(f"error: {args.out} exists; give a new folder")
    import transformers

    from oscar_calib.errors import OscarError
    from oscar_calib.fsutil import staged_dir
    from oscar_calib.model.load import load_tokenizer

    try:
        tok = load_tokenizer(args.model)
        with staged_dir(args.out, tag="tokenizer") as tmp:
            tok.save_pretrained(tmp)
    except OscarError as e:
        raise SystemExit(f"error: {e}") from None
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"{args.model}: tokenizer of {len(tok):,} entries saved by transformers {transformers.__version__} to "
          f"{args.out} ({size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
