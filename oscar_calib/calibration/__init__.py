"""Calibration: streaming float64 accumulators (:mod:`.stats`), checkpoints (:mod:`.checkpoint`),
the single-process algorithm (:mod:`.pipeline`), its report (:mod:`.report`), and the fork's
shared rotations and global clips (:mod:`.shared`). Data parallelism plugs into the pipeline's
hook points (:mod:`.ranks`) over torch.distributed (:mod:`.parallel`); :mod:`.launch` starts the
ranks. Its text and token plan come from :mod:`oscar_calib.data.corpus`."""
