"""``oscar export --target sglang-fork | sglang-fork-v2 | sglang``: an artifact as SGLang serves it
(the OSCAR fork's main, the fork's newer per-KV-head code, upstream SGLang's pull request #32129; the
loaders and files are described in :mod:`.fileformat`).

Writes into ``--out`` (staged, moved into place only when complete):

=====================================  =====================================================
file                                   content
=====================================  =====================================================
``k_rotation_<obj>.pt``                key/query rotations (:mod:`.fileformat`, the target's form;
                                       ``sglang-fork-v2``: with the artifact's ``k_mean`` per layer)
``v_rotation_<obj>.pt``                value rotations, or identities when V is already folded into
                                       the checkpoint (``v_rotation_identity.pt``)
``serve.env``                          the fork's environment variables (``set -a; . serve.env``)
``launch.sh``                          ``python -m sglang.launch_server`` with the fork's flags
``clips.json``                         the clip ratios served and where they come from, and the
                                       artifact's per-layer, per-KV-head ratios
=====================================  =====================================================

Settings SGLang needs (the fork's, which upstream's pull request keeps), all written explicitly (its own environment defaults differ from its
scripts: 32/128-token windows and no clipping): ``SGLANG_ENABLE_MIXED_KV_WINDOWS=1`` (without it the
fork silently uses a fixed Hadamard rotation and ignores the files), the rotation paths, ONE K and
ONE V clip ratio for the whole model, sink (``SGLANG_MIXED_KV_PREFIX_TOKENS``) and recent window
(``SGLANG_MIXED_KV_RECENT_TOKENS``), both multiples of 8 (its page size) with a recent window of at
least 8 tokens, BF16 windows, float32 scales, Lloyd-Max off, and
``SGLANG_OSCAR_ABSORB_V_ROTATION``.

V rotation, one rule: the fork always maps the attention output back with ``o @ R_vᵀ`` and never
touches ``o_proj``; with absorption on it folds ``R_v`` into the V rows of ``qkv_proj`` at load time
(only Qwen3 and GLM-4-MoE models do this), otherwise it rotates V online. Both are exact. A checkpoint
written by ``oscar fold-weights`` already holds ``R_v`` in ``v_proj`` rows AND ``o_proj`` columns, so
it is served with IDENTITY V rotations and absorption off; giving the fork the real ``R_v`` too
would rotate V twice (tested with a pure-torch simulation of the fork's data path).
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .... import __version__
from ....contract.artifact import Artifact
from ....contract.defaults import is_power_of_two
from ....errors import ArtifactError, InputError
from ....fsutil import atomic_write_bytes, atomic_write_text, staged_dir
from ..base import SLIDING_MODEL_TYPES, WINDOWED_KINDS
from ..ptfile import identity_payload, payload, save_bytes
from ..uniform import serving_clips
from .fileformat import (
    PER_HEAD_TARGETS,
    TARGETS,
    file_name,
    fork_load_problems,
)

ENV_FILE = "serve.env"
LAUNCH_FILE = "launch.sh"
CLIPS_FILE = "clips.json"
WINDOW_MULTIPLE = 8                          # the fork's page size N_Q = 4 × itemsize(bf16)
ABSORB_MODEL_TYPES = ("qwen3", "glm4_moe")   # the fork folds R_v into qkv_proj at load for these
# The fork's INT2 cache takes prefill fa3 or triton with triton decode (`_unified_mixed_kv_active` in
# sglang-research/python/sglang/srt/server_args.py); its fa3 backend asserts an sm80-sm90 GPU
# (`create_flashattention_v3_backend`, srt/layers/attention/attention_registry.py) and its kernels need
# CUDA >= 12.3 (`is_fa3_supported`, sgl-kernel/python/sgl_kernel/flash_attn.py). FutureMLS-Lab/OSCAR
# at commit 473ff3f9d29aac3e3730b27a2bbf97b062ec38e6.
PREFILL_BACKENDS = ("fa3", "triton")
FA3_COMPUTE_MAJORS = (8, 9)
# How the fork is installed (the same repository and commit, README "Setup"): an editable install of its
# SGLang tree; it brings the SGLANG_ENABLE_MIXED_KV_WINDOWS setting a stock sglang lacks.
FORK_REPO = "https://github.com/FutureMLS-Lab/OSCAR"
FORK_INSTALL = f"git clone --recursive {FORK_REPO} && pip install -e OSCAR/sglang-research/python"
UPSTREAM_PR = "pull request sgl-project/sglang#32129 (--kv-cache-dtype int2)"
FORK_MARKER = "SGLANG_ENABLE_MIXED_KV_WINDOWS"      # defined in the fork's sglang/srt/environ.py only


@dataclass
class ServeSettings:
    """Everything ``serve.env`` and ``launch.sh`` say."""

    target: str
    model_path: str
    group_size: int
    sink: int
    recent: int
    k_clip: float
    v_clip: float
    absorb_v: bool
    v_identity: bool
    prefill_backend: str = "fa3"

    def env(self, k_path: Path, v_path: Path) -> dict[str, str]:
        return {
            "SGLANG_ENABLE_MIXED_KV_WINDOWS": "1",
            "SGLANG_OSCAR_K_ROTATION_PATH": str(k_path),
            "SGLANG_OSCAR_V_ROTATION_PATH": str(v_path),
            "SGLANG_OSCAR_K_CLIP_RATIO": f"{self.k_clip:g}",
            "SGLANG_OSCAR_V_CLIP_RATIO": f"{self.v_clip:g}",
            "SGLANG_OSCAR_ABSORB_V_ROTATION": "1" if self.absorb_v else "0",
            "SGLANG_MIXED_KV_PREFIX_TOKENS": str(self.sink),
            "SGLANG_MIXED_KV_RECENT_TOKENS": str(self.recent),
            "SGLANG_MIXED_KV_HP_DTYPE": "bfloat16",
            "SGLANG_MIXED_KV_SCALE_DTYPE": "float32",
            "SGLANG_LLOYD_MAX": "0",
            "SGLANG_OSCAR_FUSED_ROTATE_CLIP_QUANT": "0",
        }

    def server_flags(self) -> list[str]:
        return ["--kv-cache-dtype", "int2", "--kv-cache-quant-group-size", str(self.group_size),
                "--decode-attention-backend", "triton", "--page-size", str(WINDOW_MULTIPLE)]


@dataclass
class SGLangExport:
    out: Path
    target: str
    files: list[str]
    settings: ServeSettings
    clip_source: str
    warnings: list[str] = field(default_factory=list)

    @property
    def format_version(self) -> int:
        return 2 if self.target in PER_HEAD_TARGETS else 1

    def to_dict(self) -> dict:
        return {"out": str(self.out), "format": "sglang", "target": self.target,
                "format_version": self.format_version, "files": [str(self.out / f) for f in self.files],
                "settings": asdict(self.settings), "clip_source": self.clip_source, "warnings": self.warnings}


def write_sglang(art: Artifact, artifact_path: Path, out: Path, *, target: str, model_path: str | None = None,
                 clip: tuple[float | None, float | None] = (None, None), sink: int | None = None,
                 recent: int | None = None, folded: bool | None = None, prefill_backend: str = "fa3",
                 overwrite: bool = False, warnings: list[str] = ()) -> SGLangExport:
    """The fork's files for the loaded, checked artifact ``art`` into ``out``; ``warnings``: the
    lines of the settings the target drops (they go into ``serve.env`` too)."""
    if prefill_backend not in PREFILL_BACKENDS:
        raise InputError(f"unknown --prefill-backend {prefill_backend!r}; choose from {', '.join(PREFILL_BACKENDS)}")
    st, d, g = art.settings, art.head_dim, art.group_size
    for hd in sorted(set(st.layer_head_dims)):
        _check_shapes(artifact_path, hd, g)
    sink = st.sink_tokens if sink is None else sink
    recent = st.recent_tokens if recent is None else recent
    _check_windows(sink, recent)
    k_clip, v_clip, clip_source = serving_clips(art, clip, per_head=target in PER_HEAD_TARGETS)
    folded = st.v_folded if folded is None else folded
    warnings = [*warnings, *sliding_warnings(art, target)]
    k_rots, k_eigs = _rotations(art, "k", target, artifact_path)
    if model_path is None:
        model_path, note = default_model_path(art, folded)
        warnings += [note] if note else []
    settings = ServeSettings(target, model_path, g, sink, recent, k_clip,
                             v_clip, absorb_v=not folded and st.model_type in ABSORB_MODEL_TYPES,
                             v_identity=folded, prefill_backend=prefill_backend)
    k_name = file_name("k", _objective(art, "k"))
    v_name = file_name("v", "identity" if folded else _objective(art, "v"))
    ids = st.layer_ids           # the model's layer ids: a hybrid's attention layers keep their global id
    v_obj = identity_payload(art.num_layers, st.layer_head_dims, ids) if folded else \
        payload(*_rotations(art, "v", target, artifact_path), objective=_objective(art, "v"), layer_ids=ids)
    out = Path(out)
    # key centering: the fork's newer code subtracts each layer's k_mean before the key rotation
    k_means = [lr.k_mean for lr in art.layers] if art.settings.key_centering and target in PER_HEAD_TARGETS else None
    with staged_dir(out, overwrite=overwrite, merge=True) as tmp:
        atomic_write_bytes(tmp / k_name, save_bytes(payload(k_rots, k_eigs, objective=_objective(art, "k"),
                                                            layer_ids=ids, k_means=k_means)))
        atomic_write_bytes(tmp / v_name, save_bytes(v_obj))
        for name in (k_name, v_name):     # the files must load in the fork: check them as it would
            problems = fork_load_problems(tmp / name, num_layers=art.num_layers, head_dim=d, target=target,
                                          num_kv_heads=art.num_kv_heads, layer_ids=ids,
                                          layer_heads=list(zip(st.layer_kv_heads, st.layer_head_dims)))
            if problems:
                raise ArtifactError(f"{name} would not load in {target}: {problems[0]}")
        final = out.resolve()
        env = settings.env(final / k_name, final / v_name)
        atomic_write_text(tmp / ENV_FILE, serve_env(env, settings, art, Path(artifact_path), warnings))
        atomic_write_text(tmp / LAUNCH_FILE, launch_script(settings, k_name, v_name, fork=target != "sglang"))
        os.chmod(tmp / LAUNCH_FILE, 0o755 & ~_umask())
        atomic_write_text(tmp / CLIPS_FILE, json.dumps(_clips_doc(art, k_clip, v_clip, clip_source), indent=2) + "\n")
    return SGLangExport(out, target, [k_name, v_name, ENV_FILE, LAUNCH_FILE, CLIPS_FILE], settings, clip_source,
                        warnings)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _check_shapes(where, d: int, g: int) -> None:
    if not is_power_of_two(d):
        raise ArtifactError(f"{where}: head_dim {d} is not a power of two; the fork's clip and flush kernels need "
                            "one, so this artifact cannot be served by it")
    if not is_power_of_two(g) or d % g or not is_power_of_two(d // g):
        raise ArtifactError(f"{where}: group size {g} must be a power of two dividing head_dim {d} into a power-of-two "
                            "number of groups for the fork's kernels")


def _check_windows(sink: int, recent: int) -> None:
    for name, n in (("sink", sink), ("recent", recent)):
        if n < 0 or n % WINDOW_MULTIPLE:
            raise InputError(f"--{name} {n}: the fork needs a multiple of {WINDOW_MULTIPLE} tokens (its page size)")
    if recent < WINDOW_MULTIPLE:
        raise InputError(f"--recent {recent}: the fork needs a recent window of at least {WINDOW_MULTIPLE} tokens "
                         "(with 0 its decode ring is never flushed)")


def _rotations(art: Artifact, which: str, target: str, where) -> tuple[list, list]:
    if target in PER_HEAD_TARGETS:
        return ([getattr(lr, f"{which}_rotation") for lr in art.layers],
                [getattr(lr, f"{which}_eigenvalues") for lr in art.layers])
    rots, eigs = [], []
    for i in range(art.num_layers):
        shared = art.shared_rotation(i, which)
        if shared is None:
            raise ArtifactError(f"{where}: one rotation per KV head but no shared per-layer rotations (made before "
                                "oscar 0.2); re-run `oscar calibrate` to add them, or export --target sglang-fork-v2 "
                                "for the fork's per-KV-head loader")
        rots.append(shared[0])
        eigs.append(shared[1])
    return rots, eigs


def _objective(art: Artifact, which: str) -> str:
    obj = getattr(art.settings, f"{which}_objective")
    comp = {"u_h_pbr": "r_h_pbr", "u": "r", "h": "h", "identity": "identity"}.get(art.settings.composition, "")
    return obj.replace("-", "_") + (f"_{comp}" if comp else "")


def default_model_path(art: Artifact, folded: bool) -> tuple[str, str | None]:
    """The server's ``--model-path`` and, when it cannot be right here, one line saying what to
    pass: the fold-weights checkpoint holding a folded artifact; else the local directory the
    model was calibrated from (its ``model_source``) while it exists, its hub id otherwise; else
    the ``model_id`` (a hub id, or a pip-shipped model's)."""
    from ....contract.artifact import model_source

    if folded and art.path is not None and (Path(art.path).parent / "config.json").exists():
        return str(Path(art.path).parent.resolve()), None     # the artifact copy inside a fold-weights checkpoint
    src = model_source(art.metadata) or {}
    path = src.get("path")
    if path and Path(path).exists():
        return path, None
    if src.get("hub_id"):
        return src["hub_id"], None
    if path:
        return path, (f"the model was calibrated from {path}, which is not here: pass --model-path (or set "
                      "MODEL_PATH for launch.sh) to where the server can read it")
    return art.metadata.get("model_id", ""), None


def sliding_warnings(art: Artifact, target: str) -> list[str]:
    """What the target does with a model's sliding-window layers, when it has some."""
    out = []
    types = ((art.report or {}).get("geometry") or {}).get("layer_types") or []
    sliding = any(t in WINDOWED_KINDS for t in types) or art.settings.model_type in SLIDING_MODEL_TYPES
    if sliding and target == "sglang-fork":
        out.append(f"{art.metadata.get('model_id')} has sliding-window attention layers: the fork's main turns its "
                   "OSCAR decode path off for sliding-window models (and refuses hybrid ones), so this export will "
                   "load but not run as OSCAR there; its newer code (--target sglang-fork-v2) serves them")
    elif sliding and target == "sglang":
        out.append(f"{art.metadata.get('model_id')} has sliding-window attention layers: whether upstream SGLang's "
                   "pull request runs its OSCAR path on them was not checked (docs/guides/engines.md)")
    return out


def _clips_doc(art: Artifact, k: float, v: float, source: str) -> dict:
    return {"served": {"k": k, "v": v, "source": source},
            "shared_fit": dict(zip(("k", "v"), art.shared_clips())) if art.shared_clips() else None,
            "per_layer_per_head": {"k": [lr.k_clip.tolist() for lr in art.layers],
                                   "v": [lr.v_clip.tolist() for lr in art.layers]},
            "note": "the fork applies one K and one V ratio to the whole model (SGLANG_OSCAR_{K,V}_CLIP_RATIO)"}


def serve_env(env: dict[str, str], s: ServeSettings, art: Artifact, source: Path, warnings: list[str]) -> str:
    md = art.metadata
    v_note = ("identity: V is already folded into the checkpoint's v_proj/o_proj (oscar fold-weights)"
              if s.v_identity else "absorbed into qkv_proj at load" if s.absorb_v else "rotated online")
    lines = [
        f"# OSCAR SGLang fork settings, written by `oscar export` (oscar {__version__}) for {TARGETS[s.target]}",
        f"# artifact: {source}  model: {md.get('model_id')}  fingerprint: {md.get('model_fingerprint')}",
        f"# serve model: {s.model_path}   V rotation: {v_note}",
        "# Load with `set -a; . serve.env; set +a`, or run ./launch.sh (which re-points the rotation paths",
        "# at its own directory). Without SGLANG_ENABLE_MIXED_KV_WINDOWS=1 the fork silently uses a fixed",
        "# Hadamard rotation and ignores these files.",
        *[f"# WARNING: {w}" for w in warnings],
    ]
    lines += [f"{k}={shlex.quote(v)}" for k, v in env.items()]
    return "\n".join(lines) + "\n"


def launch_script(s: ServeSettings, k_name: str, v_name: str, *, fork: bool = True) -> str:
    """``launch.sh``: checks that ``$PYTHON`` has SGLang (``fork``: the OSCAR fork, recognised by
    its own environment variable; else any sglang, for upstream's pull request, whose build is not
    recognisable) and that the prefill backend suits the GPU (one line and exit 1 when not), then
    starts the server."""
    flags = " ".join(shlex.quote(f) for f in s.server_flags())
    majors = "|".join(str(m) for m in FA3_COMPUTE_MAJORS)
    marker = f'"{FORK_MARKER}" in env.read_text(errors="replace")' if fork else "True"
    install = f"install the OSCAR fork: {FORK_INSTALL}" if fork else f"install an sglang built with {UPSTREAM_PR}"
    return f"""#!/usr/bin/env bash
# Start {"the OSCAR SGLang fork" if fork else "SGLang"} with these rotations (written by `oscar export`, oscar {__version__}).
# Usage: ./launch.sh [more sglang.launch_server flags, e.g. --port 30000 --tensor-parallel-size 4]
# Needs {"the OSCAR fork of SGLang, not a stock sglang (which ignores these settings)" if fork else "an sglang built with " + UPSTREAM_PR}:
#   {FORK_INSTALL if fork else "see the pull request"}
# Environment: MODEL_PATH (default below); PYTHON (default python); PREFILL_BACKEND (default
# {s.prefill_backend}): fa3 is FlashAttention 3, which the fork runs on sm80-sm90 GPUs (A100, L40, H100)
# with CUDA >= 12.3; elsewhere (e.g. Blackwell) use PREFILL_BACKEND=triton. The fork's INT2 cache
# takes prefill fa3 or triton, with triton decode.
set -euo pipefail
here="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
PYTHON="${{PYTHON:-python}}"
PREFILL_BACKEND="${{PREFILL_BACKEND:-{s.prefill_backend}}}"
fork=0
"$PYTHON" -c 'import importlib.util as u, pathlib, sys
s = u.find_spec("sglang")
env = pathlib.Path(s.origin).parent / "srt" / "environ.py" if s and s.origin else None
sys.exit(3 if env is None else 0 if env.is_file() and {marker} else 4)' \\
    2>/dev/null || fork=$?
case $fork in
    0) ;;
    3) echo "launch.sh: $PYTHON has no sglang; {install}" >&2; exit 1 ;;
    4) echo "launch.sh: the sglang of $PYTHON is not the OSCAR fork; {f"install it: {FORK_INSTALL}" if fork else install}" >&2; exit 1 ;;
    *) echo "launch.sh: cannot run $PYTHON (set PYTHON to the interpreter that has {"the OSCAR fork" if fork else "sglang"})" >&2; exit 1 ;;
esac
case $PREFILL_BACKEND in
    fa3)
        cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 || true)"
        case ${{cap%%.*}} in
            ""|{majors}) ;;
            *) echo "launch.sh: prefill backend fa3 needs an sm80-sm90 GPU (A100, L40, H100), this one has compute capability $cap; run PREFILL_BACKEND=triton $0" >&2; exit 1 ;;
        esac ;;
    triton) ;;
    *) echo "launch.sh: PREFILL_BACKEND=$PREFILL_BACKEND: the fork's INT2 cache takes fa3 or triton" >&2; exit 1 ;;
esac
set -a
. "$here/{ENV_FILE}"
set +a
export SGLANG_OSCAR_K_ROTATION_PATH="$here/{k_name}"
export SGLANG_OSCAR_V_ROTATION_PATH="$here/{v_name}"
MODEL_PATH="${{MODEL_PATH:-}}"
[ -n "$MODEL_PATH" ] || MODEL_PATH={shlex.quote(s.model_path)}
exec "$PYTHON" -m sglang.launch_server --model-path "$MODEL_PATH" {flags} \\
    --prefill-attention-backend "$PREFILL_BACKEND" "$@"
"""
