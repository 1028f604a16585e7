"""Artifact tools: verify (:mod:`.verify`), fold the value rotation into weights (:mod:`.fold`),
the OSCAR SGLang fork's files (:mod:`.sglang`), validation (:mod:`.validate`), hub publishing
(:mod:`.publish`) and the zoo index (:mod:`.zoo`)."""
