"""Artifact tools: fold the value rotation into weights (:mod:`.fold`), export and import for
every engine (:mod:`.export`), validation (:mod:`.validate`), hub publishing (:mod:`.publish`) and
the zoo index (:mod:`.zoo`). Verify, a measurement of an artifact, is :mod:`oscar_calib.eval.verify`."""
