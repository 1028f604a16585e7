"""What a calibration writes beside its tensors: the output-directory check, ``calibration.json``
(the report: settings, geometry, per-layer rows, summary, timings) and the model card."""

from __future__ import annotations

import json
from pathlib import Path

from .. import FORMAT_VERSION, __version__
from ..contract.artifact import (
    Artifact,
    has_artifact,
    stamp_artifact,
    write_artifact_files,
)
from ..contract.config import CalibrationConfig
from ..errors import OutputExistsError
from ..fsutil import check_can_replace, check_writable, remove_stale_temps
from ..model.load import LoadedModel
from ..model.source import load_hint


def check_output_dir(out: Path, overwrite: bool, resume: bool = False) -> None:
    """Refuse an output that holds an artifact (unless overwrite), is a file, or is unwritable, and
    one holding the checkpoint of an interrupted run unless ``resume`` (continue it) or
    ``overwrite`` (start over). Other files are fine."""
    from .checkpoint import checkpoints_in

    check_can_replace(out, overwrite=overwrite, occupied=has_artifact, what="already holds an artifact")
    check_writable(out)
    found = checkpoints_in(out)
    if found and not (resume or overwrite):
        raise OutputExistsError(f"{out} holds the checkpoint of an interrupted run ({found[0]}"
                                f"{f' and {len(found) - 1} more' if len(found) > 1 else ''}): pass --resume to "
                                "continue it, or --overwrite to start over")


def summary(rows: list[dict]) -> dict:
    """Mean held-out attention error of the calibrated rotations, of Hadamard and (when every row
    has it) of the fork's shared rotations and clips, over layers."""
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    o = [r["heldout"]["oscar"]["attn"] for r in rows]
    h = [r["heldout"]["hadamard"]["attn"] for r in rows]
    out = {"mean_attn_error_oscar": mean(o), "mean_attn_error_hadamard": mean(h),
           "layers_better_than_hadamard": sum(a < b for a, b in zip(o, h)), "num_layers": len(rows)}
    if all("fork" in r["heldout"] for r in rows):
        out["mean_attn_error_fork"] = mean([r["heldout"]["fork"]["attn"] for r in rows])
    return out


def build_report(cfg: CalibrationConfig, lm: LoadedModel, metadata: dict[str, str], group_size: int,
                 rows: list[dict], timing: dict, fork_clips) -> dict:
    """``calibration.json``: the run's settings, calibration data, geometry, per-layer rows, timings
    and the fork's global (K, V) clip pair."""
    geo = lm.geometry
    return {
        "format_version": FORMAT_VERSION, "toolkit_version": __version__, "model_id": lm.source.model_id,
        "model_source": lm.source.record(), "model_load": load_hint(lm.source),
        "model_fingerprint": lm.fingerprint, "settings": cfg.to_dict(), "group_size": group_size,
        "calibration": json.loads(metadata["calibration"]), "geometry": geo.__dict__ | {"layer_types": list(geo.layer_types)},
        "summary": summary(rows), "layers": rows, "timings": timing, "fork_clips": list(fork_clips),
    }


def write_outputs(out: Path, artifact: Artifact, report: dict) -> None:
    """``oscar.safetensors``, ``README.md`` (the model card) and ``calibration.json`` into ``out``
    (temporaries a killed earlier run left there are removed first: this run owns ``out``); the
    report and the card record the content digest the safetensors file stores."""
    from ..contract.card import model_card
    from ..contract.layout import CARD_NAME, DIGEST_KEY, REPORT_NAME, WEIGHTS_NAME

    remove_stale_temps(out, [WEIGHTS_NAME, CARD_NAME, REPORT_NAME])
    report[DIGEST_KEY] = stamp_artifact(artifact)          # the report and the card show what the file stores
    write_artifact_files(out, artifact, model_card(report), report)
