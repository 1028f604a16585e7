"""SGLang's three OSCAR loaders as export targets: the OSCAR fork's main (``sglang-fork``), the fork's
newer per-KV-head code (``sglang-fork-v2``) and upstream SGLang's pull request #32129 (``sglang``).
Files and loader rules: :mod:`.fileformat`; the export itself (files, ``serve.env``, ``launch.sh``,
``clips.json``): :mod:`.export`."""

from __future__ import annotations

from pathlib import Path

from ..base import (
    Checked,
    ExportResult,
    ExportSettings,
    ExportTarget,
    Geometry,
    Launch,
    per_head_note,
    wrong_paths,
)
from ..uniform import uniform_group_note
from .export import (
    CLIPS_FILE,
    ENV_FILE,
    LAUNCH_FILE,
    ServeSettings,
    SGLangExport,
    write_sglang,
)
from .fileformat import (
    PER_HEAD_TARGETS,
    TARGETS,
    check_target,
    file_name,
    fork_load_problems,
    read_rotation_file,
)

FORK_MAIN = Checked(
    "FutureMLS-Lab/OSCAR (main)", "473ff3f9d",
    ("sglang-research/python/sglang/srt/mem_cache/memory_pool.py: load_oscar_rotations",
     "sglang-research/python/sglang/srt/environ.py: SGLANG_OSCAR_* / SGLANG_MIXED_KV_*",
     "rotation/compute_kv_rotation.py: the V1 writer"))
FORK_V2 = Checked(
    "FutureMLS-Lab/OSCAR (newer code; PR #20)", "8dbf789065",
    ("python/sglang/srt/mem_cache/memory_pool.py: load_oscar_rotations (by global layer id, a hybrid's attention "
     "layers only; head_dim one per layer for gemma4_unified's 256/512 layers), load_oscar_rotation_field (k_mean: "
     "[d] or [h_kv, d] per layer, every layer or none)",
     "rotation/tests/test_oscar2_transforms.py @ 2911dd3f9a: the pool subtracts k_mean from every key before "
     "the key rotation"),
    status="partial",
    note="PR #20's head was not readable; the rules are the fork's newer code, which carries the per-head loader")
UPSTREAM = Checked(
    "sgl-project/sglang (PR #32129)", "166afca4bc",
    ("python/sglang/srt/mem_cache/unified_kv_pool.py: UnifiedInt2HPKVPool.__init__ (calls load_oscar_rotations "
     "for a contiguous layer range; group size defaults to head_dim; windows multiples of N_Q)",),
    status="partial",
    note="the PR's memory_pool.py (its load_oscar_rotations) was not readable at that revision; its files are "
         "checked as the fork's main loader, which the PR says it ports")


# the fork's main refuses attention sinks on its INT2 path (read at 473ff3f9d)
FORK_MAIN_SINKS = ("the fork's Triton decode raises NotImplementedError for sinks with its INT2 windows "
                   "(sglang-research/python/sglang/srt/layers/attention/triton_backend.py: forward_decode)")
# how each loader treats a hybrid model (layers with a recurrent state beside the attention layers)
HYBRID = {
    # 473ff3f9d, model_runner_kv_cache_mixin.py _init_pools: a "mambaish" model gets HybridLinearKVPool with a plain
    # MHATokenToKVPool inside, never UnifiedInt2HPKVPool (the branch zhongzhu/hybrid-model, 797e39c7c, adds that and
    # keys its rotation files by the attention layers' global ids, as its Qwen3.5 recipes do)
    "sglang-fork": ("the fork's main backs a hybrid model's attention layers with its plain BF16 pool "
                    "(HybridLinearKVPool in sglang-research/python/sglang/srt/model_executor/"
                    "model_runner_kv_cache_mixin.py: _init_pools), so it would not load these rotations; its newer "
                    "code keys them by global layer id: --target sglang-fork-v2"),
    "sglang": ("upstream SGLang's pull request loads rotations for a contiguous layer range "
               "(UnifiedInt2HPKVPool.__init__ at 166afca4bc); how it serves a hybrid model's attention layers was "
               "not read"),
}


class SGLangTarget(ExportTarget):
    engine = "SGLang"
    reads = "K.pt V.pt (the fork's files: V1 [d, d] or V2 [h, d, d] per layer)"

    def __init__(self, name: str, checked: Checked, serves: frozenset[str]):
        self.name, self.checked, self.summary, self.serves = name, checked, TARGETS[name], serves
        self.engine = {"sglang-fork": "the OSCAR SGLang fork", "sglang-fork-v2": "the OSCAR SGLang fork (per-head)",
                       "sglang": "upstream SGLang"}[name]

    def install(self, art, artifact_path: Path, out: Path, s: ExportSettings, warnings: list[str], *,
                overwrite: bool = False) -> ExportResult:
        """The fork's own layout (:func:`.export.write_sglang`: rotation files, serve.env, launch.sh,
        clips.json), re-read with the fork's loader rules before it is installed."""
        r: SGLangExport = write_sglang(art, artifact_path, out, target=self.name, model_path=s.model_path,
                                       clip=s.clip, sink=s.sink, recent=s.recent, folded=s.folded,
                                       prefill_backend=s.prefill_backend, overwrite=overwrite, warnings=warnings)
        final = Path(out).resolve()
        launch = Launch(r.settings.env(final / r.files[0], final / r.files[1]),
                        ["python", "-m", "sglang.launch_server", "--model-path", r.settings.model_path,
                         *r.settings.server_flags(), "--prefill-attention-backend", r.settings.prefill_backend])
        settings = r.to_dict()["settings"] | {"clip_source": r.clip_source, "format_version": r.format_version}
        return ExportResult(Path(out), self.name, r.files, launch, settings, self.checked, r.warnings, detail=r)

    def feature_wording(self, name: str, art, s: ExportSettings) -> str | None:
        if name == "layer_group_sizes":
            return uniform_group_note(art, self.engine)
        if name == "per_head_rotations":
            return per_head_note(art, self.engine, "fork")
        if name == "attention_sinks" and self.name == "sglang-fork":
            return (f"the model ({art.settings.model_type}) adds a learned attention-sink logit per query head to its "
                    f"softmax, and {FORK_MAIN_SINKS}")
        if name == "layer_ids" and self.name in HYBRID:
            return f"the artifact's layers are a hybrid model's attention layers, and {HYBRID[self.name]}"
        return None

    def refusals(self, art, s: ExportSettings) -> list[str]:
        # a hybrid whose attention layers are all its layers (Falcon-H1) maps no ids, and still has the recurrent states
        if art.settings.hybrid and not art.settings.mapped_layers and self.name in HYBRID:
            return [f"{art.settings.model_type} is a hybrid model (a recurrent state beside attention), and "
                    f"{HYBRID[self.name]}"]
        return []

    def load_problems(self, out: Path, geo: Geometry) -> list[str]:
        names = sorted(p.name for p in Path(out).glob("*_rotation_*.pt"))
        problems = []
        for which in ("k", "v"):
            files = [n for n in names if n.startswith(f"{which}_rotation_")]
            if len(files) != 1:
                problems.append(f"{out} holds {len(files)} {which.upper()} rotation files, expected one")
                continue
            problems += [f"{files[0]}: {p}" for p in fork_load_problems(
                Path(out) / files[0], num_layers=geo.num_layers, head_dim=geo.head_dim, target=self.name,
                num_kv_heads=geo.num_kv_heads, layer_ids=geo.layer_ids,
                layer_heads=[geo.heads(i) for i in range(geo.num_layers)])]
        return problems

    def read(self, paths: list[Path], geo: Geometry):
        if len(paths) != 2:
            wrong_paths(self, paths, "a K file and a V file")
        return tuple(read_rotation_file(p, num_layers=geo.num_layers, num_kv_heads=geo.num_kv_heads,
                                        head_dim=geo.head_dim, layer_ids=geo.layer_ids) for p in paths)


# what each loader honours besides the rotations (every one: one group size for all layers and both caches,
# ONE K and ONE V clip ratio, BF16 sink and recent windows, no logit-noise correction; the fork's newer code
# also subtracts a per-layer key mean, k_mean)
TARGET_LIST = [SGLangTarget("sglang-fork", FORK_MAIN, frozenset({"windows"})),
               SGLangTarget("sglang-fork-v2", FORK_V2, frozenset({"windows", "per_head_rotations", "key_centering",
                                                                  "layer_ids", "layer_head_dims"})),
               SGLangTarget("sglang", UPSTREAM, frozenset({"windows"}))]


def export_sglang(artifact_path: Path, out: Path, *, target: str = "sglang-fork", model_path: str | None = None,
                  clip: tuple[float | None, float | None] = (None, None), sink: int | None = None,
                  recent: int | None = None, folded: bool | None = None, prefill_backend: str = "fa3",
                  overwrite: bool = False) -> SGLangExport:
    """Write the fork's files for the artifact at ``artifact_path`` into ``out`` (see the module
    docstring of :mod:`.export`) through the target's :meth:`~oscar_calib.tools.export.base.ExportTarget.export`
    (its checks, then :func:`write_sglang`). ``folded`` (default: the artifact's ``v_folded``) serves
    a checkpoint made by ``oscar fold-weights``; ``model_path`` defaults to that checkpoint, else
    the base model id."""
    check_target(target)
    s = ExportSettings(model_path=model_path, clip=clip, sink=sink, recent=recent, folded=folded,
                       prefill_backend=prefill_backend)
    chosen = next(t for t in TARGET_LIST if t.name == target)
    return chosen.export(artifact_path, out, s, overwrite=overwrite).detail


__all__ = ["CLIPS_FILE", "ENV_FILE", "LAUNCH_FILE", "PER_HEAD_TARGETS", "TARGETS", "TARGET_LIST", "SGLangExport",
           "SGLangTarget", "ServeSettings", "export_sglang", "file_name", "fork_load_problems",
           "read_rotation_file"]
