"""What the parts of ``bench_kernels.py`` share: the shapes, the run's context and small helpers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from harness import Clock, Device, graph_ms, rotating_copies, stream_ms

QWEN = {"q_heads": 32, "kv_heads": 8, "head_dim": 128, "group_size": 128}
QUICK_SHAPE = {"q_heads": 4, "kv_heads": 2, "head_dim": 64, "group_size": 64}
SINK, RECENT = 64, 256
QUICK_SINK, QUICK_RECENT = 8, 16  # --quick: a small BF16 window keeps the interpreter's calls short


@dataclass
class Ctx:
    """One run: its arguments, device, clock and timing choices."""

    args: object
    device: Device
    clock: Clock
    quick: bool = False
    variants: list = field(default_factory=list)
    # kernels_flashinfer.flashinfer_status(): the module, or why FlashInfer is not timed
    flashinfer: dict = field(default_factory=lambda: {"available": False, "skipped": "FlashInfer not checked"})

    @property
    def sink(self) -> int:
        return QUICK_SINK if self.quick else SINK

    @property
    def recent(self) -> int:
        return QUICK_RECENT if self.quick else RECENT

    @property
    def cuda(self) -> bool:
        return self.device.cuda

    @property
    def dev(self) -> str:
        return "cuda" if self.cuda else "cpu"

    @property
    def l2(self) -> int:
        return self.device.l2_bytes

    def log(self, msg: str) -> None:
        self.clock.log(msg)

    def over_budget(self) -> bool:
        return self.clock.over_budget()

    def time(self, fns) -> float:
        """Median ms of one call of ``fns`` (rotating), replayed from CUDA graphs with L2 flushed
        (on the CPU, one call: a smoke test)."""
        return graph_ms(fns, cuda=self.cuda, flush=self.args.flush, cpu_reps=1)

    def stream(self, fns) -> float:
        """Per-call ms of ``fns`` back to back in one CUDA graph (:func:`harness.stream_ms`)."""
        return stream_ms(fns, cuda=self.cuda)

    def copies(self, ws_bytes: int) -> int:
        return rotating_copies(ws_bytes, self.l2, cuda=self.cuda)

    def free_bytes(self) -> int:
        if self.cuda:
            import torch

            return int(torch.cuda.mem_get_info()[0])
        return 8 << 30

    def empty_cache(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.empty_cache()


def int2_bytes(batch, kvh, d, g, hist, window, dtype_bytes=2) -> int:
    """Bytes the INT2 decode must read: K+V codes and params of the history, K+V window."""
    per_tok = 2 * (d // 4 + 2 * 2 * (d // g))
    return batch * kvh * (hist * per_tok + window * 2 * d * dtype_bytes)


def kernel_info(k) -> dict:
    """Registers, spills and shared memory of a compiled Triton kernel (what the version exposes)."""
    if k is None:
        return {}
    out = {}
    for name in ("n_regs", "n_spills", "shared"):
        v = getattr(k, name, None)
        if isinstance(v, (int, float)):
            out[name] = v
    meta = getattr(k, "metadata", None)
    shared = getattr(meta, "shared", None)
    if "shared" not in out and isinstance(shared, int):
        out["shared"] = shared
    return out


def int_list(text: str | None, flag: str) -> list[int]:
    """``"1,32"`` -> ``[1, 32]``; None -> ``[]``; anything else is one line and exit 1."""
    if text is None:
        return []
    try:
        vals = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"error: {flag} {text!r}: expected comma-separated positive integers") from None
    if not vals or min(vals) < 1:
        raise SystemExit(f"error: {flag} {text!r}: expected comma-separated positive integers")
    return vals


def parse_variants(text: str, flag: str = "--variants") -> list[dict]:
    """``--variants`` / ``--write-variants``: a JSON list of config dicts, inline or in a file."""
    p = Path(text)
    if text.lstrip().startswith("["):
        raw = text
    elif p.is_file():
        raw = p.read_text()
    else:
        raise SystemExit(f"error: {flag} {text!r} is neither a JSON list nor a file")
    try:
        val = json.loads(raw)
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: {flag} is not JSON: {e}") from None
    if not isinstance(val, list) or not all(isinstance(v, dict) for v in val):
        raise SystemExit(f"error: {flag} must be a JSON list of config objects")
    return val
