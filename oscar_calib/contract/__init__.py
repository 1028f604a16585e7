"""Contracts only: the calibration settings (:mod:`.config`), the scheme's defaults and shape rules
(:mod:`.defaults`), and the artifact format v1: its names (:mod:`.layout`), its safetensors files
(:mod:`.stfile`), its content digest (:mod:`.digest`), its checks (:mod:`.values` and
:mod:`.checks`, the one function every reader goes through), the artifact in memory with its one
artifact-matches-model check (:mod:`.artifact`), ``verify.json``'s tie to the content it verified
(:mod:`.verification`) and the model card (:mod:`.card`). Nothing here loads a model."""
