"""``oscar export --target llamacpp --gguf model.gguf``: the rotations baked into a COPY of the user's
GGUF as llama.cpp's OSCAR fork loads them (the input is never modified).

Read for this module (nothing copied): OSCAR's own llama.cpp fork, FutureMLS-Lab/OSCAR branch
``zhongzhu/llamacpp`` at 4570ea609:

========================================================  ==============================================
rule                                                      where
========================================================  ==============================================
per layer ``blk.{i}.attn_k_rot.weight`` and               ``src/llama-arch.cpp`` (tensor names),
``blk.{i}.attn_v_rot.weight``, ne ``{head_dim_k,          ``src/models/qwen3.cpp: load_arch_tensors``
head_dim_k}``, optional per layer (TENSOR_NOT_REQUIRED)   (``create_tensor``)
only the ``qwen3`` architecture creates them; a GGUF      ``src/llama-model-loader.cpp:
holding tensors its architecture does not create fails     done_getting_tensors``
to load ("wrong number of tensors")
applied post-RoPE as ``ggml_mul_mat(rot, Q)`` and         ``src/models/qwen3.cpp: graph``
``ggml_mul_mat(rot, K)``, which is ``x @ rotᵀ`` in row
terms: the file stores ``Mᵀ`` so that keys become
``K @ M``; V likewise, the output mapped back with
``o @ Mᵀ`` before ``attn_output``; F32, as the fork's
baking script writes them                                 ``oscar-rotation/export_rot_kv_gguf.py``
KV cache type ``q2_0`` (``--cache-type-k/-v q2_0``)       ``common/arg.cpp: kv_cache_types``
env ``LLAMA_KV_NO_HADAMARD=1`` (the calibrated rotation   ``ggml/src/ggml-quants.c:
replaces the in-quant Hadamard), ``LLAMA_KV_CLIP_RATIO``  quantize_row_q2_0_ref``
(ONE ratio for K and V)
env ``LLAMA_KV_HP_SINK`` / ``LLAMA_KV_HP_RECENT``: F16    ``src/llama-kv-cache.cpp``
sink and recent window beside the q2_0 cache
========================================================  ==============================================

TheTom/llama-cpp-turboquant's pull requests #233/#234 (closed; their branch in giveen/llama-cpp-
turboquant, ``src/models/qwen3.cpp`` read at 67bbbb9d30) load the same tensors the same way and add an
``oscar2`` cache type and more architectures (gemma4, qwen3moe per its README, not read here): a GGUF
written by this export loads there for ``qwen3``; the other architectures are not accepted.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from ...contract.defaults import ORTHOGONALITY_TOL
from ...errors import ArtifactError, InputError
from .base import (
    Checked,
    ExportSettings,
    ExportTarget,
    Geometry,
    Launch,
    ReadRotations,
    Written,
    per_head_note,
    rotation_problem,
    shared_missing,
    shared_rotations,
    sliding_window_note,
    wrong_paths,
)
from .uniform import serving_clips

ARCHITECTURES = ("qwen3",)           # the architectures whose loader creates attn_k_rot / attn_v_rot
# transformers model_type -> llama.cpp architecture, for saying what a GGUF of the model would be
GGUF_ARCH = {"qwen3": "qwen3", "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3",
             "gemma3": "gemma3", "gemma2": "gemma2", "qwen3_moe": "qwen3moe", "glm4_moe": "glm4moe"}


def architecture_problem(model_type: str) -> str | None:
    """Why a GGUF of a model of this transformers type cannot carry the rotations (None: it can)."""
    arch = GGUF_ARCH.get(model_type, model_type)
    if arch in ARCHITECTURES:
        return None
    return (f"its GGUF architecture is {arch!r}, and the fork's loader creates attn_k_rot/attn_v_rot only for "
            f"{', '.join(ARCHITECTURES)} (src/models/qwen3.cpp); any other architecture fails to load a GGUF holding "
            "them ('wrong number of tensors')")
BLOCK = 32                           # q2_0 block (QK2_0)
K_ROT = "blk.{}.attn_k_rot.weight"
V_ROT = "blk.{}.attn_v_rot.weight"


def rot_name(which: str, layer: int) -> str:
    return (K_ROT if which == "k" else V_ROT).format(layer)


def to_gguf(r: torch.Tensor) -> np.ndarray:
    """A rotation ``R`` (``x @ R``) as the fork stores it: ``Rᵀ``, F32, row-major, so that
    ``ggml_mul_mat(tensor, x)`` computes ``x @ R``."""
    return np.ascontiguousarray(r.detach().to("cpu", torch.float32).numpy().T)


def from_gguf(a: np.ndarray) -> torch.Tensor:
    """The rotation ``R`` a stored tensor applies (the inverse of :func:`to_gguf`)."""
    return torch.from_numpy(np.ascontiguousarray(np.asarray(a, dtype=np.float32).T))


def _reader(path: Path):
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such GGUF file")
    try:
        return GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - the reader raises many types for a bad file
        raise InputError(f"{path}: not a readable GGUF file ({type(e).__name__}: {str(e)[:100]})") from None


def _field(reader, key: str):
    f = reader.get_field(key)
    return None if f is None else f.contents()


def gguf_geometry(reader) -> dict:
    """Architecture and attention geometry from a GGUF's metadata."""
    arch = _field(reader, "general.architecture")
    heads = _field(reader, f"{arch}.attention.head_count")
    kv = _field(reader, f"{arch}.attention.head_count_kv")
    emb = _field(reader, f"{arch}.embedding_length")
    d = _field(reader, f"{arch}.attention.key_length") or (emb // heads if emb and heads else None)
    dv = _field(reader, f"{arch}.attention.value_length") or d
    return {"architecture": arch, "num_layers": _field(reader, f"{arch}.block_count"), "num_kv_heads": kv if kv
            is not None else heads, "head_dim": d, "v_head_dim": dv}


class LlamaCppTarget(ExportTarget):
    name = "llamacpp"
    engine = "llama.cpp (OSCAR fork)"
    summary = ("llama.cpp, OSCAR's zhongzhu/llamacpp branch: F32 blk.{i}.attn_k_rot/attn_v_rot baked (transposed) "
               "into a copy of your GGUF; --cache-type-k/-v q2_0")
    reads = "model.gguf (a GGUF holding blk.{i}.attn_k_rot.weight / attn_v_rot.weight)"
    checked = Checked(
        "FutureMLS-Lab/OSCAR (branch zhongzhu/llamacpp)", "4570ea609",
        ("src/models/qwen3.cpp: llama_model_qwen3::load_arch_tensors, graph",
         "src/llama-model-loader.cpp: done_getting_tensors",
         "ggml/src/ggml-quants.c: quantize_row_q2_0_ref, dequantize_row_q2_0",
         "src/llama-kv-cache.cpp: LLAMA_KV_HP_SINK / LLAMA_KV_HP_RECENT (F16 window)",
         "oscar-rotation/export_rot_kv_gguf.py: its baking script (F32, transposed)"))

    # attn_{k,v}_rot [D, D] per layer; LLAMA_KV_HP_SINK / LLAMA_KV_HP_RECENT; q2_0's own fixed blocks
    serves = frozenset({"windows"})

    def feature_wording(self, name: str, art, s: ExportSettings) -> str | None:
        if name == "per_head_rotations":
            return per_head_note(art, self.engine, "llamacpp")
        if name == "layer_group_sizes":
            return (f"{self.engine} stores q2_0 (blocks of {BLOCK} values with their own levels) in every layer: the "
                    "artifact's per-layer group sizes are not served (`oscar eval --methods llamacpp`)")
        return None

    def refusals(self, art, s: ExportSettings) -> list[str]:
        if s.gguf is None:
            raise InputError("--target llamacpp needs --gguf MODEL.gguf: the model's GGUF, which the rotations are "
                             "baked into (a new file; the input is not modified)")
        geo = gguf_geometry(_reader(s.gguf))
        out = []
        if geo["architecture"] not in ARCHITECTURES:
            out.append(f"{Path(s.gguf).name} is a {geo['architecture']!r} model, and the fork's loader creates "
                       f"attn_k_rot/attn_v_rot only for {', '.join(ARCHITECTURES)} (src/models/qwen3.cpp); any other "
                       "architecture fails to load a GGUF holding them ('wrong number of tensors')")
        want = {"num_layers": art.num_layers, "num_kv_heads": art.num_kv_heads, "head_dim": art.head_dim,
                "v_head_dim": art.head_dim}
        bad = [f"{k} {geo[k]} (artifact: {v})" for k, v in want.items() if geo[k] != v]
        if bad:
            out.append(f"{Path(s.gguf).name} does not match the artifact: {', '.join(bad)}")
        if any(t.name.endswith(("attn_k_rot.weight", "attn_v_rot.weight")) for t in _reader(s.gguf).tensors):
            out.append(f"{Path(s.gguf).name} already holds OSCAR rotations: pass the base model's GGUF")
        return out + self.artifact_refusals(art)

    def artifact_refusals(self, art) -> list[str]:
        """What the fork cannot serve whatever the GGUF: sliding-window layers, no shared rotations,
        a head_dim that is not whole q2_0 blocks."""
        out = []
        sliding = sliding_window_note(art)
        if sliding:
            out.append(f"{sliding}; the fork applies rotations only in its qwen3 graph")
        missing = shared_missing(art)
        if missing:
            out.append(missing)
        if art.head_dim % BLOCK:
            out.append(f"head_dim {art.head_dim} is not a whole number of q2_0 blocks of {BLOCK} (the cache's per-head "
                       "views need whole blocks)")
        return out

    def write(self, art, tmp: Path, final: Path, s: ExportSettings) -> Written:
        from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

        src = Path(s.gguf)
        name = src.stem + "-oscar.gguf"
        if (final / name).resolve() == src.resolve():
            raise InputError(f"--out {final} would replace the input {src}: choose another directory")
        st = art.settings
        folded = st.v_folded if s.folded is None else s.folded
        k_rots = shared_rotations(art, "k", self.engine)[0]
        v_rots = [] if folded else shared_rotations(art, "v", self.engine)[0]
        reader = _reader(src)
        arch = _field(reader, "general.architecture")
        writer = GGUFWriter(tmp / name, arch, endianess=reader.endianess)
        for key, f in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            vtype = f.types[0]
            writer.add_key_value(key, f.contents(), vtype, sub_type=f.types[-1] if vtype == GGUFValueType.ARRAY else None)
            if key == "general.alignment":
                writer.data_alignment = int(f.contents())
        added = [(rot_name("k", i), to_gguf(r)) for i, r in enumerate(k_rots)]
        added += [(rot_name("v", i), to_gguf(r)) for i, r in enumerate(v_rots)]
        for t in reader.tensors:
            writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
        for n, a in added:
            writer.add_tensor_info(n, a.shape, a.dtype, a.nbytes, GGMLQuantizationType.F32)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in reader.tensors:
            writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
        for _, a in added:
            writer.write_tensor_data(a, tensor_endianess=reader.endianess)
        writer.close()

        k_clip, v_clip, source = serving_clips(art, s.clip)
        sink = st.sink_tokens if s.sink is None else s.sink
        recent = st.recent_tokens if s.recent is None else s.recent
        warnings = []
        if k_clip != v_clip:
            warnings.append(f"llama.cpp applies ONE clip ratio to K and V (LLAMA_KV_CLIP_RATIO): serving K's {k_clip:g} "
                            f"for both (V's was {v_clip:g})")
        warnings.append("q2_0 quantises each 128-value chunk of a token's K (and V) row, all KV heads concatenated: the "
                        "chunk's mean is subtracted, then 4 Lloyd-Max levels per 32 values scaled by their RMS (3 bits "
                        "per element), not the artifact's uniform INT2 groups (`oscar eval --methods llamacpp`)")
        env = {"LLAMA_KV_NO_HADAMARD": "1", "LLAMA_KV_CLIP_RATIO": f"{k_clip:g}", "LLAMA_KV_HP_SINK": str(sink),
               "LLAMA_KV_HP_RECENT": str(recent)}
        notes = [f"model: {name} = {src.name} + F32 {'attn_k_rot' if folded else 'attn_k_rot/attn_v_rot'} for "
                 f"{art.num_layers} layers (stored transposed)",
                 "V rotation: " + ("none in the GGUF (V already folded into its weights by oscar fold-weights)"
                                   if folded else "attn_v_rot, undone on the attention output before attn_output")]
        launch = Launch(env, ["llama-cli", "-m", str(final / name), "--cache-type-k", "q2_0", "--cache-type-v", "q2_0",
                              "--flash-attn", "off"], notes)
        settings = {"gguf": name, "source_gguf": str(src.resolve()), "clip": k_clip, "clip_source": source,
                    "sink": sink, "recent": recent, "v_identity": folded, "architecture": arch}
        return Written([name], launch, {}, settings, warnings)

    def load_problems(self, out: Path, geo: Geometry) -> list[str]:
        files = sorted(Path(out).glob("*.gguf"))
        if len(files) != 1:
            return [f"{out} holds {len(files)} GGUF files, expected one"]
        return gguf_load_problems(files[0], geo)

    def read(self, paths: list[Path], geo: Geometry) -> tuple[ReadRotations, ReadRotations]:
        if len(paths) != 1:
            wrong_paths(self, paths, "one GGUF")
        return read_gguf_rotations(Path(paths[0]), geo)


def gguf_load_problems(path: Path, geo: Geometry) -> list[str]:
    """Would the fork load ``path`` with every layer's K (and V) rotated? Its rules (module
    docstring) plus what serving needs: F32, orthogonal to 1e-5, every layer's K rotation, V on
    every layer or none (none: V folded into the weights)."""
    reader = _reader(path)
    g = gguf_geometry(reader)
    if g["architecture"] not in ARCHITECTURES:
        return [f"{path.name}: architecture {g['architecture']!r} does not load attn_k_rot/attn_v_rot "
                f"(only {', '.join(ARCHITECTURES)})"]
    if g["num_layers"] != geo.num_layers or g["head_dim"] != geo.head_dim:
        return [f"{path.name}: {g['num_layers']} blocks of head_dim {g['head_dim']}, the model has {geo.num_layers} "
                f"of {geo.head_dim}"]
    tensors = {t.name: t for t in reader.tensors}
    problems = []
    stray = [n for n in tensors if n.endswith(("attn_k_rot.weight", "attn_v_rot.weight"))
             and int(n.split(".")[1]) >= geo.num_layers]
    if stray:
        problems.append(f"{path.name}: rotation tensors beyond the model's blocks: {stray[:4]}")
    v_present = [i for i in range(geo.num_layers) if rot_name("v", i) in tensors]
    if v_present and len(v_present) != geo.num_layers:
        problems.append(f"{path.name}: attn_v_rot on {len(v_present)} of {geo.num_layers} blocks: the other blocks "
                        "would serve V unrotated")
    d = geo.head_dim
    for i in range(geo.num_layers):
        for which in ("k", "v") if v_present else ("k",):
            t = tensors.get(rot_name(which, i))
            if t is None:
                problems.append(f"{path.name}: no {rot_name(which, i)}: the fork would serve block {i} unrotated")
                continue
            if t.tensor_type.name != "F32" or [int(x) for x in t.shape] != [d, d]:
                problems.append(f"{path.name}: {t.name} is {t.tensor_type.name} {[int(x) for x in t.shape]}, expected "
                                f"F32 [{d}, {d}]")
                continue
            p = rotation_problem(from_gguf(t.data), f"{path.name}: {t.name}", (d, d), ORTHOGONALITY_TOL)
            if p:
                problems.append(p)
    return problems


def read_gguf_rotations(path: Path, geo: Geometry) -> tuple[ReadRotations, ReadRotations]:
    """K and V rotations baked into a GGUF (V: identity when no block has attn_v_rot, i.e. V folded
    into the weights). Anything the fork would not load is one :class:`ArtifactError`."""
    problems = gguf_load_problems(path, geo)
    if problems:
        raise ArtifactError(problems[0])
    reader = _reader(path)
    tensors = {t.name: t for t in reader.tensors}
    out = []
    for which in ("k", "v"):
        h = hashlib.sha256()
        rots, notes = [], []
        for i in range(geo.num_layers):
            t = tensors.get(rot_name(which, i))
            if t is None:
                rots.append(torch.eye(geo.head_dim).unsqueeze(0))
                continue
            a = np.asarray(t.data, dtype=np.float32)
            h.update(a.tobytes())
            rots.append(from_gguf(a).unsqueeze(0))
        if which == "v" and not any(rot_name("v", i) in tensors for i in range(geo.num_layers)):
            notes.append("no attn_v_rot in the GGUF (V folded into its weights): imported as the identity")
        out.append(ReadRotations(f"{path.name}#{which}", "gguf-f32-transposed", rots, h.hexdigest(), notes=notes))
    return out[0], out[1]


TARGET = LlamaCppTarget()
