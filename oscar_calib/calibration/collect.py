"""The streaming pass of a calibration: every calibration batch through the model with capture on,
its post-RoPE Q/K/V and attention outputs folded into each layer's float64 accumulators
(:mod:`.stats`), checkpointed every ``checkpoint_every`` batches (:mod:`.checkpoint`), then the
held-out rows the fitting reads (:class:`StatsRun`). Data parallelism changes it only through the
:class:`~.ranks.Ranks` hooks."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..contract.config import CalibrationConfig, stable_hash
from ..data.corpus import TokenPlan
from ..errors import InputError, UnsupportedModelError
from ..model.capture import Capture, call_window, capture_forward
from ..model.load import LoadedModel
from ..model.placement import input_device
from ..progress import ProgressFn, report, step
from .checkpoint import interruptible, load_checkpoint, save_checkpoint
from .ranks import Ranks
from .stats import ACCUMULATORS, LayerStats, Reservoir, check_finite, require_finite


@dataclass
class StatsRun:
    """Accumulators of every layer plus the held-out reservoir."""

    stats: list[LayerStats]
    reservoir: list[Reservoir]
    batches_done: int = 0
    checkpointed: int = 0        # batches in the newest checkpoint (0: none)
    layer_info: dict = field(default_factory=dict)    # layer -> {"scaling", "sliding_window", "softcap", "sinks", "chunk"}
    fit_device: str = "cpu"      # where the clips and held-out errors are fitted (see fit_device)
    fitting: list[int] | None = None    # the layers whose held-out rows this process keeps (None: all)
    key_means: list[torch.Tensor] | None = None   # per layer, a mean key from other windows (center_seq_len)

    def key_mean(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s mean key ``[h, d]`` float64: :attr:`key_means`' when set, else its statistics'."""
        return self.stats[layer].key_mean() if self.key_means is None else self.key_means[layer]

    def observer(self, collect: str):
        def observe(layer, module, q, k, v, o, kwargs):
            if layer not in self.layer_info:
                sw = call_window(module, kwargs)
                cfg = getattr(module, "config", None)
                sinks = kwargs.get("s_aux")           # gpt-oss: a learned sink logit per query head
                types, lid = getattr(cfg, "layer_types", None) or (), getattr(module, "layer_idx", layer)
                chunked = lid < len(types) and types[lid] == "chunked_attention"
                self.layer_info[layer] = {
                    "scaling": float(getattr(module, "scaling", q.shape[-1] ** -0.5)),
                    "sliding_window": sw,
                    "softcap": getattr(cfg, "attn_logit_softcapping", None),
                    "sinks": None if sinks is None else [float(x) for x in sinks.detach().float().cpu()],
                    "chunk": int(cfg.attention_chunk_size) if chunked else None,
                }
            if collect == "stats":
                s = self.stats[layer]
                if torch.device(s.device) != q.device:          # a device map put this layer elsewhere: follow it
                    s.to(q.device)
                s.update(q, k, v, o)              # finiteness: checked on the small sums (check_finite)
            elif self.fitting is None or layer in self.fitting:
                require_finite(layer, {"k": k, "v": v, "q": q, "s": o})
                self.reservoir[layer].add(q, k, v, o)
        return observe


def collect_statistics(lm: LoadedModel, plan: TokenPlan, cfg: CalibrationConfig, *,
                       checkpoint: Path | None = None, resume: bool = False,
                       progress: ProgressFn | None = None,
                       on_batch: Callable[[int], None] | None = None,
                       ranks: Ranks | None = None) -> tuple[StatsRun, dict]:
    """Stream the calibration batches through the model, then capture the held-out rows.

    ``ranks`` (default: one process) supplies the data-parallel hooks: this process's share of the
    batches, the sst-approx pilot exchange, the sum over ranks, and the layers whose held-out rows it
    keeps (its share of the fitting, ``run.fitting``). The accumulators end on the CPU."""
    geo, model = lm.geometry, lm.model
    ranks = ranks or Ranks()
    dev = input_device(model)
    all_batches = plan.batches(cfg.batch_size)
    batches = [b.to(dev) for b in ranks.shard(all_batches)]     # ids up front: no host sync per batch
    approx = cfg.v_objective == "sst-approx"     # s_approx costs a float64 pass: only when asked for
    pilot = ranks.plan_pilot(all_batches, cfg.pilot_tokens, approx)
    run = StatsRun(
        stats=[LayerStats(lg.num_kv_heads, lg.group, lg.head_dim, pilot, device=dev, approx=approx)
               for lg in map(geo.layer, range(geo.num_layers))],
        reservoir=[Reservoir(cfg.heldout_tokens) for _ in range(geo.num_layers)],
        fit_device=fit_device(dev),
        fitting=ranks.fit_share(geo.num_layers),
    )
    parts = {"cfg": cfg.fingerprint_fields(), "model": lm.fingerprint, "tokens": plan.sha256(),
             "sums": list(ACCUMULATORS), **({} if approx else {"s_approx": False}), **ranks.key_parts()}
    key = stable_hash(parts)
    resumed = bool(resume and checkpoint is not None and load_checkpoint(checkpoint, run, key))
    run.checkpointed = run.batches_done
    total = sum(b.numel() for b in batches)
    done_tokens = sum(b.numel() for b in batches[:run.batches_done])
    report(progress, "capture", done_tokens, total, "tokens")
    t0 = time.perf_counter()
    with torch.no_grad(), Capture(model, [run.observer("stats")]) as cap, interruptible(run, len(batches), checkpoint):
        ranks.after_batch(run.stats, run.batches_done)
        for i in range(run.batches_done, len(batches)):
            capture_forward(model, batches[i])
            if cap.calls == 0:
                raise UnsupportedModelError("the model's attention does not go through transformers' attention "
                                            "interface; its Q/K/V cannot be captured")
            run.batches_done = i + 1
            done_tokens += batches[i].numel()
            report(progress, "capture", done_tokens, total, "tokens")
            # finiteness is checked (one device sync) where a checkpoint is due and at the end
            if (run.batches_done % cfg.checkpoint_every == 0) and run.batches_done < len(batches):
                check_finite(run.stats)
                if checkpoint is not None:
                    save_checkpoint(checkpoint, run, key)
                    run.checkpointed = run.batches_done
            if on_batch:
                on_batch(run.batches_done)
            ranks.after_batch(run.stats, run.batches_done)
        check_finite(run.stats)
    t_stats = time.perf_counter() - t0
    ranks.reduce(run.stats)
    for s in run.stats:
        s.to("cpu")
    t1 = time.perf_counter()
    with step(progress, "held-out rows"), torch.no_grad(), Capture(model, [run.observer("heldout")]):
        for seq in plan.heldout:           # every rank: the rows of the layers it fits
            capture_forward(model, seq.unsqueeze(0).to(dev))
    timing = {"statistics_s": t_stats, "gather_s": t1 - t_stats - t0, "heldout_s": time.perf_counter() - t1,
              "resumed": resumed, "batches": len(all_batches), **ranks.timing(batches)}
    return run, timing


def fit_device(model_device: torch.device) -> str:
    """Where the held-out fits run (attention over every held-out row, a clip grid per head: after
    the capture the largest cost, ~54 s of a 64-layer, 64-head model on 32 CPU cores): the GPU that
    runs the model's first layer when there is one, else the CPU; ``OSCAR_FIT_DEVICE`` (e.g.
    ``cpu`` where the GPUs are full) overrides it."""
    forced = os.environ.get("OSCAR_FIT_DEVICE", "").strip()
    if forced:
        try:
            return str(torch.device(forced))
        except RuntimeError:
            raise InputError(f"OSCAR_FIT_DEVICE={forced!r} is not a device (e.g. cpu, cuda:0)") from None
    return str(model_device) if model_device.type == "cuda" else "cpu"


__all__ = ["StatsRun", "collect_statistics", "fit_device"]
