"""Ablations that were measured and not adopted: kept runnable for the research drivers in
``scripts/experiments/``, outside the product path (no command, evaluation method, artifact field
or kernel names them).

=============================  ===================================================================
module                         what it holds
=============================  ===================================================================
:mod:`.codebook`               calibrated 4-level codebooks for the 2-bit history (quantisers
                               ``codebook`` / ``codebook-std`` of :class:`.codebook.CodebookScheme`,
                               read by the perplexity simulation only)
:mod:`.channel`                keys quantised per channel in blocks of tokens as they leave the
                               window, KIVI's and OScaR's key axis (quantiser ``channel`` of
                               :class:`.channel.ChannelScheme`, perplexity simulation only)
=============================  ===================================================================

Importing a module registers what it adds with the product's one extension point
(:func:`oscar_calib.runtime.simulate.register_quantizer`); importing this package imports nothing.
"""
