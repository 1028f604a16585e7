"""``oscar export --target T`` and ``oscar import --from T``: one artifact, every engine that loads
OSCAR rotations. One module per engine (:mod:`.sglang`, :mod:`.vllm`, :mod:`.llamacpp`, :mod:`.onnxruntime`, :mod:`.mlx`); each target
restates its engine's loader rules (cited revision in :attr:`~.base.ExportTarget.checked`) and re-reads
what it wrote with them before the output directory is installed (:mod:`.base`)."""

from __future__ import annotations

from pathlib import Path

from ...errors import InputError
from .base import (
    Checked,
    ExportResult,
    ExportSettings,
    ExportTarget,
    Geometry,
    ReadRotations,
)
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
    were checked against, the status, and which artifact settings its engine serves (``serves``) or
    not (``drops``: the export names each one it meets, or refuses)."""
    from ...contract.features import FEATURES

    return [{"target": t.name, "engine": t.engine, "summary": t.summary, "repo": t.checked.repo,
             "revision": t.checked.revision, "status": t.checked.status, "where": list(t.checked.where),
             "note": t.checked.note, "imports": t.reads,
             "serves": [f for f in FEATURES if f in t.serves], "drops": [f for f in FEATURES if f not in t.serves]}
            for t in TARGETS.values()]


def serving_table(artifact: Path, out_root: str = "serve") -> list[dict]:
    """For a model card and the docs: for every target, the export command for ``artifact`` and the
    engine's launch settings it writes (env and command line, paths under ``out_root/TARGET``), or
    the one-line reason the engine cannot serve it. Each export runs for real in a temporary
    directory (so the settings are the ones written, loader checks included)."""
    import shlex
    import tempfile

    from ...contract.artifact import load_artifact
    from ...errors import OscarError
    from .llamacpp import architecture_problem

    art = load_artifact(Path(artifact))
    rows = []
    with tempfile.TemporaryDirectory(prefix=".oscar-serving-") as tmp:
        for t in TARGETS.values():
            row = {"target": t.name, "engine": t.engine, "checked": t.checked.line(), "status": t.checked.status}
            where = f"{out_root}/{t.name}"
            cmd = ["oscar", "export", "<this directory>", "--target", t.name, "--out", where]
            if t.name == "llamacpp":            # needs the user's GGUF: the artifact's own reasons only
                cmd[-2:-2] = ["--gguf", "<model>.gguf"]
                why = [*t.setting_lines(art, ExportSettings())[1], architecture_problem(art.metadata.get("model_type", "")),
                       *t.artifact_refusals(art)]
                why = [w for w in why if w]
                row.update(export=shlex.join(cmd).replace("'", ""), **({"refused": why[0]} if why else {}))
                rows.append(row)
                continue
            try:
                res = t.export(Path(artifact), Path(tmp) / t.name, ExportSettings())
            except OscarError as e:
                row.update(export=shlex.join(cmd).replace("'", ""), refused=str(e).split(": ", 1)[-1])
                rows.append(row)
                continue
            final = str((Path(tmp) / t.name).resolve())
            env = {k: v.replace(final, where) for k, v in res.launch.env.items()}
            row.update(export=shlex.join(cmd).replace("'", ""), env=env,
                       argv=[a.replace(final, where) for a in res.launch.argv], notes=res.launch.notes,
                       warnings=res.warnings)
            rows.append(row)
    return rows


__all__ = ["TARGETS", "Checked", "ExportResult", "ExportSettings", "ExportTarget", "Geometry", "ImportResult",
           "ModelTarget", "ReadRotations", "export_artifact", "get_target", "guess_source", "import_files",
           "import_rotations", "serving_table", "target_rows"]
