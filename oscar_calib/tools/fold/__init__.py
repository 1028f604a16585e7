"""Fold an artifact's value rotation into the weights: ``v_proj`` rows and ``o_proj`` columns.

=================  ==========================================================================
module             what it holds
=================  ==========================================================================
``weights``        the maths (``W_v,h' = Rᵀ W_v,h``, ``b_h' = b_h R``, ``W_o[:, j]' = W_o[:, j] R``),
                   the artifact-vs-model checks and the per-layer layout checks
``proof``          original vs folded model on one sample batch: logits equal and every layer's
                   values equal the original values times ``R``, or nothing is written
``checkpoint``     :func:`fold_checkpoint`: the sharded Hugging Face checkpoint and the reload check
``output``         what every fold writes beside its checkpoint: the artifact copy (``oscar/``,
                   ``v_folded = "true"``), the output-directory checks, file hashes
``fp8``            compressed-tensors FP8 checkpoints (per-channel / per-tensor scales), folded on
                   their safetensors files the way the OSCAR SGLang fork absorbs ``R_v``:
                   de-quantise, rotate, fresh scales ``amax/448``, re-quantise, proven on logits
=================  ==========================================================================

The attention weights ``softmax(q kᵀ)`` do not involve V, so the folded model computes the same
logits; its V cache holds ``v R`` and an INT2 cache quantises that directly, with no run-time
rotation of V. Keys are untouched: ``k_rotation`` is applied online (after RoPE it cannot be
folded). The output checkpoint records what was folded (``config.json`` key ``oscar``, and the
artifact copy), so no engine rotates V twice.
"""

from .checkpoint import (
    OUT_DTYPES,
    RELOAD_TOLERANCE,
    FoldResult,
    fold_checkpoint,
    reload_check,
)
from .fp8 import (
    FP8_TOLERANCE,
    FP8Checkpoint,
    dequantize_fp8,
    dequantized_copy,
    fold_fp8_checkpoint,
    fp8_checkpoint,
    fp8_strategy,
    quantize_fp8,
    refold_fp8,
)
from .output import ARTIFACT_SUBDIR, check_fold_output, file_sha256, write_artifact_copy
from .proof import (
    CHECK_TOLERANCE,
    SAMPLE_SHAPE,
    FoldCheck,
    fold_and_check,
    logits_of,
    rel_diff,
    run_and_capture,
    sample_input_ids,
    value_errors,
)
from .weights import (
    CONFIG_KEY,
    FOLDED_KEY,
    FoldTarget,
    check_artifact_matches,
    fold_layer,
    fold_targets,
    fold_v_rotation,
    require_valid_values,
)

__all__ = ["ARTIFACT_SUBDIR", "CHECK_TOLERANCE", "CONFIG_KEY", "FOLDED_KEY", "FP8_TOLERANCE", "FP8Checkpoint",
           "OUT_DTYPES", "RELOAD_TOLERANCE", "dequantize_fp8", "dequantized_copy", "fold_fp8_checkpoint",
           "fp8_checkpoint", "fp8_strategy", "quantize_fp8", "refold_fp8",
           "SAMPLE_SHAPE", "FoldCheck", "FoldResult", "FoldTarget", "check_artifact_matches", "check_fold_output",
           "file_sha256", "fold_and_check", "fold_checkpoint", "fold_layer", "fold_targets", "fold_v_rotation",
           "logits_of", "rel_diff", "reload_check", "require_valid_values", "run_and_capture",
           "sample_input_ids", "value_errors", "write_artifact_copy"]
