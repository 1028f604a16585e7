"""``oscar export --target onnxruntime``: an artifact as ONNX Runtime's
``com.microsoft.MixedPrecisionGroupQueryAttention`` takes it (pull request microsoft/onnxruntime#31726,
read at 88330957a3: ``docs/oscar_onboarding_guide.md`` and the operator tests'
``quantize_dequantize_oscar2bit`` / ``_canonical_mixed_rot_reference`` /
``create_oscar2bit_mixed_rot_gqa_graph``; nothing copied).

There is no rotation file: a GQA graph is rewritten so that each ``GroupQueryAttention`` node becomes
a ``MixedPrecisionGroupQueryAttention`` node with

* inputs 18/19 ``oscar_rotation_k`` / ``oscar_rotation_v``: constant initializers ``(H_kv, D, D)``
  applied as ``x @ R`` per KV head (the attention output mapped back with ``R_vᵀ``); one rotation
  per KV head is allowed, so the artifact's per-head rotations go in as they are;
* attributes ``kv_quant_group_size`` (divides D), ``k_quant_rho`` / ``v_quant_rho`` (clip ratio in
  ``(0, 1]``, the sorted-index rule ``sorted(|row|)[min(int(ρ·D), D-1)]``, one per node),
  ``metadata_type`` (``fp32`` or ``fp16`` scale/minimum per group), ``sink_size``,
  ``recent_size``, ``cache_format_version`` = 1;
* rotations refused when ``sink_size == recent_size == 0`` (they run only on the mixed path);
* the past/present KV retyped to ``UINT8[B, H_kv, S, D/4 + (D/G)·2·meta_bytes]`` and the
  high-precision window wired as inputs 16/17 and outputs 4/5 (``past_hp_key`` / ``past_hp_value``,
  ``(B, H_kv, sink+recent, D)``, the query's dtype).

This export writes the initializers and attributes (``oscar_rotations.safetensors`` with
``layers.{i}.oscar_rotation_k`` / ``oscar_rotation_v``, ``mpgqa_nodes.json`` with every node's
attributes and the graph changes above, in the order of the graph's GQA nodes = decoder layers), and
re-reads them with those rules. The graph surgery itself is the user's step (the guide's Step 1b);
oscar does not depend on ``onnx``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ...contract import stfile
from ...contract.artifact import tensor_entries
from ...contract.defaults import ORTHOGONALITY_TOL
from ...errors import ArtifactError
from ...fsutil import atomic_write_bytes, atomic_write_text
from .base import (
    Checked,
    ExportSettings,
    ExportTarget,
    Geometry,
    Launch,
    ReadRotations,
    Written,
    rotation_problem,
    wrong_paths,
)
from .uniform import serving_clips

ROTATIONS_FILE = "oscar_rotations.safetensors"
NODES_FILE = "mpgqa_nodes.json"
OP_TYPE = "MixedPrecisionGroupQueryAttention"
METADATA_TYPES = {"fp32": 4, "fp16": 2}


def rot_key(which: str, layer: int) -> str:
    return f"layers.{layer}.oscar_rotation_{which}"


def packed_head_size(d: int, g: int, metadata_type: str = "fp32") -> int:
    """The UINT8 last dimension of the 2-bit cache rows: ``D/4`` codes + ``(D/G)`` (scale, min) pairs."""
    return d // 4 + (d // g) * 2 * METADATA_TYPES[metadata_type]


class OnnxRuntimeTarget(ExportTarget):
    name = "onnxruntime"
    engine = "ONNX Runtime"
    summary = ("ONNX Runtime PR #31726: MixedPrecisionGroupQueryAttention nodes, (H_kv, D, D) initializers and "
               "node attributes (no rotation file; a graph patch)")
    reads = f"{ROTATIONS_FILE} (written by this export: (H_kv, D, D) per layer)"
    # (H_kv, D, D) initializers; one node per layer, each with ONE kv_quant_group_size for K and V; sink_size/recent_size
    # a hybrid model's attention layers: the i-th GQA node of the graph is its i-th attention layer
    serves = frozenset({"per_head_rotations", "layer_group_sizes", "windows", "layer_ids"})
    checked = Checked(
        "microsoft/onnxruntime (PR #31726)", "88330957a3",
        ("docs/oscar_onboarding_guide.md: Steps 1b-5 (node, attributes, packed layout, window I/O, rotations)",
         "onnxruntime/test/python/transformers/test_gqa*.py: quantize_dequantize_oscar2bit, "
         "_canonical_mixed_rot_reference, create_oscar2bit_mixed_rot_gqa_graph"),
        status="partial",
        note="the operator's C++ kernel was not read; its rules are the PR's guide and its tests' references, and "
             "no patched graph is written (the initializers and attributes are)")

    def feature_wording(self, name: str, art, s: ExportSettings) -> str | None:
        if name == "layer_head_dims":
            from ...contract.features import heads_text

            return (f"the model's layers differ in head geometry ({heads_text(art.settings)}), and ONNX Runtime's "
                    f"{OP_TYPE} kernel was not read for nodes of different head sizes (the guide's graphs have one)")
        return None

    def refusals(self, art, s: ExportSettings) -> list[str]:
        st = art.settings
        sink = st.sink_tokens if s.sink is None else s.sink
        recent = st.recent_tokens if s.recent is None else s.recent
        out = []
        if sink == 0 and recent == 0:
            out.append("ONNX Runtime rejects rotations when sink_size == recent_size == 0 (they run only on its mixed "
                       "path): pass --sink or --recent")
        if art.head_dim % 4:
            out.append(f"head_dim {art.head_dim} is not a multiple of 4 (four 2-bit codes per byte)")
        return out

    def write(self, art, tmp: Path, final: Path, s: ExportSettings) -> Written:
        md, st = art.metadata, art.settings
        sink = st.sink_tokens if s.sink is None else s.sink
        recent = st.recent_tokens if s.recent is None else s.recent
        k_clip, v_clip, source = serving_clips(art, s.clip) if art.shared_clips() or s.clip != (
            None, None) else (*_uniform_clips(art), "the artifact's (equal for every layer and KV head)")
        tensors, nodes = {}, []
        for i, lr in enumerate(art.layers):
            tensors[rot_key("k", i)] = lr.k_rotation.float().contiguous()
            tensors[rot_key("v", i)] = (torch.eye(lr.v_rotation.shape[-1]).expand_as(lr.v_rotation).contiguous()
                                        if st.v_folded else lr.v_rotation.float().contiguous())
            g = st.layer_groups[i].k          # one size per node for K and V (the values' own: split_group_sizes)
            nodes.append({"layer": i, "model_layer": st.layer_ids[i], "op_type": OP_TYPE, "domain": "com.microsoft",
                          "attributes": {"kv_quant_group_size": g, "k_quant_rho": k_clip, "v_quant_rho": v_clip,
                                         "metadata_type": "fp32", "sink_size": sink, "recent_size": recent,
                                         "cache_format_version": 1},
                          "inputs": {"18": rot_key("k", i), "19": rot_key("v", i), "16": f"past_hp_key_values.{i}.key",
                                     "17": f"past_hp_key_values.{i}.value"},
                          "outputs": {"4": f"present_hp.{i}.key", "5": f"present_hp.{i}.value"},
                          "kv_cache": {"dtype": "UINT8", "packed_head_size": packed_head_size(art.head_dim, g)}})
        meta = {"format": "oscar-onnxruntime-mpgqa", "model_id": md.get("model_id", ""),
                "num_kv_heads": str(art.num_kv_heads), "head_dim": str(art.head_dim)}
        atomic_write_bytes(tmp / ROTATIONS_FILE, stfile.serialize(tensor_entries(tensors), meta))
        doc = {"op_type": OP_TYPE, "domain": "com.microsoft", "checked": self.checked.line(),
               "patch": ["replace the i-th com.microsoft.GroupQueryAttention node (graph order: the model's i-th "
                         "attention layer, decoder layer nodes[i].model_layer) with "
                         f"{OP_TYPE}, keeping its attributes (num_heads, kv_num_heads, scale, do_rotary, "
                         "local_window_size, ...) and adding nodes[i].attributes",
                         "add layers.{i}.oscar_rotation_k / _v from oscar_rotations.safetensors as FLOAT constant "
                         "initializers (H_kv, D, D) wired to inputs 18 / 19",
                         "retype past/present .key/.value to UINT8 [B, H_kv, S, kv_cache.packed_head_size]; seed an "
                         "empty past as [B, H_kv, 0, packed_head_size]",
                         "add graph inputs past_hp_key_values.{i}.key/.value (B, H_kv, sink+recent, D), query's dtype, "
                         "wired to inputs 16 / 17, and outputs present_hp.{i}.key/.value at outputs 4 / 5; feed "
                         "present_hp back as past_hp every step"],
               "nodes": nodes}
        atomic_write_text(tmp / NODES_FILE, json.dumps(doc, indent=2) + "\n")
        notes = ["no server command: patch the GQA graph as mpgqa_nodes.json says, then run it on the CPU EP"]
        settings = {"k_clip": k_clip, "v_clip": v_clip, "clip_source": source, "sink": sink, "recent": recent,
                    "group_sizes": st.k_groups, "rotations": "per KV head"}
        return Written([ROTATIONS_FILE, NODES_FILE], Launch({}, [], notes), {}, settings, [])

    def load_problems(self, out: Path, geo: Geometry) -> list[str]:
        try:
            tensors, doc = _read_bundle(Path(out))
        except ArtifactError as e:
            return [str(e)]
        problems = []
        nodes = doc.get("nodes") or []
        if len(nodes) != geo.num_layers:
            problems.append(f"{NODES_FILE} has {len(nodes)} nodes, the model has {geo.num_layers} layers")
        for i, node in enumerate(nodes):
            a = node.get("attributes", {})
            g = a.get("kv_quant_group_size")
            if not isinstance(g, int) or (g != 0 and (g < 0 or geo.head_dim % g)):
                problems.append(f"node {i}: kv_quant_group_size {g!r} must divide head_dim {geo.head_dim} (0: one group)")
            for rho in ("k_quant_rho", "v_quant_rho"):
                if not isinstance(a.get(rho), (int, float)) or not 0 < a[rho] <= 1:
                    problems.append(f"node {i}: {rho} {a.get(rho)!r} must lie in (0, 1]")
            if a.get("metadata_type") not in METADATA_TYPES or a.get("cache_format_version") != 1:
                problems.append(f"node {i}: metadata_type must be fp32 or fp16 and cache_format_version 1")
            if not a.get("sink_size") and not a.get("recent_size"):
                problems.append(f"node {i}: rotations with sink_size == recent_size == 0 are rejected")
        for i in range(geo.num_layers):
            for which in ("k", "v"):
                p = rotation_problem(tensors.get(rot_key(which, i)), f"{rot_key(which, i)}",
                                     (geo.num_kv_heads, geo.head_dim, geo.head_dim), ORTHOGONALITY_TOL)
                if p:
                    problems.append(p)
        return problems

    def read(self, paths: list[Path], geo: Geometry) -> tuple[ReadRotations, ReadRotations]:
        if len(paths) != 1:
            wrong_paths(self, paths, f"one {ROTATIONS_FILE}")
        path = Path(paths[0])
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(path))
        except Exception as e:  # noqa: BLE001 - safetensors raises several types for a bad file
            raise ArtifactError(f"{path}: not a safetensors file ({type(e).__name__})") from None
        out = []
        for which in ("k", "v"):
            rots = []
            for i in range(geo.num_layers):
                t = tensors.get(rot_key(which, i))
                p = rotation_problem(t, f"{path.name}: {rot_key(which, i)}", (geo.num_kv_heads, geo.head_dim,
                                                                               geo.head_dim), ORTHOGONALITY_TOL)
                if p:
                    raise ArtifactError(p)
                rots.append(t.float())
            h = hashlib.sha256(b"".join(r.numpy().tobytes() for r in rots)).hexdigest()
            out.append(ReadRotations(f"{path.name}#{which}", "onnxruntime-initializers", rots, h))
        return out[0], out[1]


def _uniform_clips(art) -> tuple[float, float]:
    ks = {round(float(c), 6) for lr in art.layers for c in lr.k_clip}
    vs = {round(float(c), 6) for lr in art.layers for c in lr.v_clip}
    if len(ks) != 1 or len(vs) != 1:
        raise ArtifactError(f"{art.path}: no global clip ratios recorded; pass --clip k=RATIO,v=RATIO")
    return ks.pop(), vs.pop()


def _read_bundle(out: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(out / ROTATIONS_FILE))
        doc = json.loads((out / NODES_FILE).read_text())
    except Exception as e:  # noqa: BLE001 - a missing or damaged bundle file, one line
        raise ArtifactError(f"{out}: not a complete ONNX Runtime bundle ({type(e).__name__}: {str(e)[:80]})") from None
    return tensors, doc


TARGET = OnnxRuntimeTarget()
