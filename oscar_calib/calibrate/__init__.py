"""Calibration: the corpus and token plan (:mod:`.corpus`), streaming float64 accumulators
(:mod:`.stats`), checkpoints (:mod:`.checkpoint`), the single-process algorithm
(:mod:`.pipeline`) and data parallelism over torch.distributed (:mod:`.parallel`)."""
