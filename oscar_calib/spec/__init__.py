"""Contracts only: the calibration settings (:mod:`.config`), the scheme's defaults and shape rules
(:mod:`.defaults`), the artifact format v1 with its one artifact-matches-model check
(:mod:`.artifact`) and the model card (:mod:`.card`). Nothing here loads a model."""
