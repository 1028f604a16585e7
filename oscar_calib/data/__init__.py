"""Text and tokens every stage reads: the embedded corpora, local files and hub data sets, cut into
the seeded token plan of calibration and held-out sequences (:mod:`.corpus`). Calibration reads
the embedded corpus' first half; verify, eval and fold-weights' proof read its second."""
