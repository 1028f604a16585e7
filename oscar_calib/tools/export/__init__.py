"""``oscar export --target T`` and ``oscar import --from T``: one artifact, every engine that loads
OSCAR rotations. One module per engine (:mod:`.sglang`, :mod:`.vllm`, :mod:`.llamacpp`, :mod:`.onnxruntime`, :mod:`.mlx`); each target
restates its engine's loader rules (cited revision in :attr:`~.base.ExportTarget.checked`) and re-reads
what it wrote with them before the output directory is installed (:mod:`.base`)."""

from __future__ import annotations

from pathlib import Path

from ...errors import InputError
from .base import Checked, ExportResult, ExportSettings, ExportTarget, Geometry, ReadRotations
from .importer import ImportResult, ModelTarget, import_rotations
from .llamacpp import TARGET as LLAMACPP
from .mlx import TARGET as MLX
from .onnxruntime import TARGET as ONNXRUNTIME
from .sglang import TARGET_LIST as SGLANG_TARGETS
from .vllm import TARGET as VLLM

TARGETS: dict[str, ExportTarget] = {t.name: t for t in (*SGLANG_TARGETS, VLLM, LLAMACPP, ONNXRUNTIME, MLX)}


def get_target(name: str) -> ExportTarget:
    if name not in TARGETS:
        raise InputError(f"unknown target {name!r}; choose from {', '.join(TARGETS)} (`oscar export --target list`)")
    return TARGETS[name]


def export_artifact(artifact: Path, out: Path, target: str, settings: ExportSettings | None = None, *,
                    overwrite: bool = False) -> ExportResult:
    """Export ``artifact`` for ``target`` into ``out`` (see :meth:`~.base.ExportTarget.export`)."""
    return get_target(target).export(Path(artifact), Path(out), settings or ExportSettings(), overwrite=overwrite)


def import_files(target: str, paths: list[Path], model, out: Path, **kw) -> ImportResult:
    """An artifact for ``model`` from the files ``target``'s engine loads (``oscar import``)."""
    t = get_target(target)
    paths = [Path(p) for p in paths]
    return import_rotations(lambda geo: t.read(paths, geo), model, out, engine=t.engine,
                            **kw)


def guess_source(paths: list[Path]) -> str:
    """The ``--from`` an import's files imply: a ``.gguf`` is llama.cpp's, ``.pt`` pairs SGLang's."""
    suffixes = {Path(p).suffix.lower() for p in paths}
    if suffixes == {".gguf"}:
        return "llamacpp"
    if suffixes == {".pt"}:
        return "sglang-fork"
    if suffixes == {".safetensors"}:
        return "onnxruntime" if len(paths) == 1 else "mlx-lm"
    raise InputError(f"cannot tell which engine's files {', '.join(map(str, paths))} are: pass --from "
                     f"({', '.join(TARGETS)})")


def target_rows() -> list[dict]:
    """What ``oscar export --target list`` prints: every target, its engine, the revision its rules
    were checked against and the status."""
    return [{"target": t.name, "engine": t.engine, "summary": t.summary, "repo": t.checked.repo,
             "revision": t.checked.revision, "status": t.checked.status, "where": list(t.checked.where),
             "note": t.checked.note, "imports": t.reads} for t in TARGETS.values()]


__all__ = ["TARGETS", "Checked", "ExportResult", "ExportSettings", "ExportTarget", "Geometry", "ImportResult",
           "ModelTarget", "ReadRotations", "export_artifact", "get_target", "guess_source", "import_files",
           "import_rotations", "target_rows"]
