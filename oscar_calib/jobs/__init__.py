"""Job supervision for work spread over several processes, apart from what they compute: joining a
torch.distributed job and its collectives (:mod:`.session`), the liveness watch that stops the
survivors of a dead rank (:mod:`.heartbeat`), and starting local ranks through torch's elastic
launcher (:mod:`.launch`). Data-parallel calibration (:mod:`oscar_calib.calibration.parallel`) runs
on it."""
