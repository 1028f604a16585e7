"""The OSCAR SGLang fork: its rotation files (:mod:`.fileformat`), ``oscar export --format sglang``
(:mod:`.export`: the files, ``serve.env`` and ``launch.sh`` the fork runs) and ``oscar import``
(:mod:`.importer`)."""

from __future__ import annotations

from .export import (
                         CLIPS_FILE,
                         ENV_FILE,
                         LAUNCH_FILE,
                         ExportResult,
                         ServeSettings,
                         export_sglang,
                         serving_clips,
)
from .fileformat import (
                         TARGETS,
                         RotationFile,
                         file_name,
                         fork_load_problems,
                         identity_payload,
                         payload,
                         read_rotation_file,
)
from .importer import ImportResult, ModelTarget, import_card, import_sglang

__all__ = ["CLIPS_FILE", "ENV_FILE", "LAUNCH_FILE", "TARGETS", "ExportResult", "ImportResult", "ModelTarget",
           "RotationFile", "ServeSettings", "export_sglang", "file_name", "fork_load_problems", "identity_payload",
           "import_card", "import_sglang", "payload", "read_rotation_file", "serving_clips"]
