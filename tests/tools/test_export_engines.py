"""One artifact, every engine: each export target's files pass its engine's restated loader
checks (with the cited revision), round-trip through ``oscar import``, and follow the engine's
conventions (``k @ R`` vs ggml's ``x @ Wᵀ``, clip index vs quantile, global layer ids, native
layers), proven numerically. The engines' rules live in ``oscar_calib/tools/export/*`` docstrings."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from oscar_calib.cli import app
from oscar_calib.contract.artifact import load_artifact
from oscar_calib.errors import ArtifactError, InputError
from oscar_calib.numerics.quant import clip_threshold
from oscar_calib.tools.export import (
    TARGETS,
    ExportSettings,
    Geometry,
    ModelTarget,
    export_artifact,
    import_files,
)
from oscar_calib.tools.export.llamacpp import (
    from_gguf,
    gguf_load_problems,
    rot_name,
    to_gguf,
)
from oscar_calib.tools.export.ptfile import payload, save_bytes
from oscar_calib.tools.export.sglang import fork_load_problems
from oscar_calib.tools.export.vllm import parse_checkpoint, vllm_load_problems
from oscar_calib.tools.validate import validate_artifact

runner = CliRunner()
ZOO = Path(__file__).resolve().parents[2] / "zoo"
SMOL, GEMMA = ZOO / "smollm2-135m", ZOO / "gemma3-270m"


def zoo_target(path: Path) -> ModelTarget:
    """The model an artifact records, as an import target (no weights loaded)."""
    art = load_artifact(path)
    md = art.metadata
    return ModelTarget(md["model_id"], md.get("model_type", ""), md["model_fingerprint"], art.num_layers,
                       int(md["num_attention_heads"]), art.num_kv_heads, art.head_dim)


def shared(path: Path, which: str) -> list[torch.Tensor]:
    art = load_artifact(path)
    return [art.shared_rotation(i, which)[0] for i in range(art.num_layers)]


def write_gguf(path: Path, *, arch: str = "qwen3", layers: int = 30, heads: int = 9, kv: int = 3, d: int = 64,
               extra: dict[str, np.ndarray] | None = None) -> Path:
    """A tiny GGUF with a model's attention metadata, an F32 and a Q8_0 tensor (no real weights)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    w = GGUFWriter(path, arch)
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_embedding_length(heads * d)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_string("general.name", "tiny test model")
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((8, heads * d)).astype(np.float32))
    q = quantize(rng.standard_normal((4, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q, raw_dtype=GGMLQuantizationType.Q8_0)
    for name, a in (extra or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ----------------------------------------------------------------------------- the registry

def test_target_list_names_every_engine_with_its_revision():
    r = runner.invoke(app, ["export", "--target", "list", "--json"])
    assert r.exit_code == 0, r.output
    rows = {row["target"]: row for row in json.loads(r.stdout)}
    assert set(rows) == {"sglang-fork", "sglang-fork-v2", "sglang", "vllm", "llamacpp", "onnxruntime",
                         "mlx-lm"} == set(TARGETS)
    assert rows["llamacpp"]["revision"] == "4570ea609" and rows["sglang-fork"]["revision"] == "473ff3f9d"
    for row in rows.values():
        assert row["repo"] and row["where"] and row["status"] in ("checked", "partial")
        assert row["status"] == "checked" or row["note"]          # a partial check says what was not checked
    bad = runner.invoke(app, ["export", str(SMOL), "--target", "tensorrt", "--out", "x"])
    assert isinstance(bad.exception, InputError) and "tensorrt" in str(bad.exception) and "vllm" in str(bad.exception)


# ----------------------------------------------------------------------------- vLLM

def test_vllm_export_of_the_smollm2_zoo_artifact(tmp_path):
    res = export_artifact(SMOL, tmp_path / "vllm", "vllm")
    out = tmp_path / "vllm"
    assert sorted(p.name for p in out.iterdir()) == sorted(res.files) == sorted(
        ["k_rotation.pt", "v_rotation.pt", "serve.env", "launch.sh", "settings.json"])
    geo = Geometry(30, 3, 64)
    assert TARGETS["vllm"].load_problems(out, geo) == []
    table = parse_checkpoint(torch.load(out / "k_rotation.pt", weights_only=True))   # as vLLM reads it
    assert sorted(table) == list(range(30))                                           # global layer ids
    for i, r in enumerate(shared(SMOL, "k")):
        assert torch.equal(table[i], r)                                               # x @ R: not transposed
    art = load_artifact(SMOL)
    env = res.launch.env
    assert (float(env["VLLM_OSCAR_K_CLIP_RATIO"]), float(env["VLLM_OSCAR_V_CLIP_RATIO"])) == art.shared_clips()
    assert env["VLLM_OSCAR_GROUP_SIZE"] == "64" and (env["VLLM_OSCAR_PREFIX_TOKENS"], env["VLLM_OSCAR_RECENT_TOKENS"]) \
        == ("64", "256")
    assert env["VLLM_OSCAR_K_ROTATION_PATH"] == str((out / "k_rotation.pt").resolve())
    assert res.launch.argv == ["vllm", "serve", "HuggingFaceTB/SmolLM2-135M-Instruct", "--kv-cache-dtype", "oscar_int2"]
    launch = (out / "launch.sh").read_text()
    assert 'export VLLM_OSCAR_K_ROTATION_PATH="$here/k_rotation.pt"' in launch and "oscar_int2" in launch
    settings = json.loads((out / "settings.json").read_text())
    assert settings["checked"]["revision"] == TARGETS["vllm"].checked.revision
    assert settings["native_layers"] == [0, 1, 28, 29]
    assert any("3 per-KV-head" in w for w in res.warnings)          # what the [d, d]-only loader loses


def test_vllm_refusals_in_one_line(tmp_path):
    with pytest.raises(ArtifactError, match="sliding-window .* ignores sliding_window"):
        export_artifact(GEMMA, tmp_path / "g", "vllm")
    with pytest.raises(ArtifactError, match="--group-size 32: .*group_size >= head_dim = 64"):
        export_artifact(SMOL, tmp_path / "s", "vllm", ExportSettings(group_size=32))
    assert not (tmp_path / "g").exists() and not (tmp_path / "s").exists()       # nothing half-written
    r = runner.invoke(app, ["export", str(GEMMA), "--target", "vllm", "--out", str(tmp_path / "c")])
    assert isinstance(r.exception, ArtifactError) and str(r.exception).startswith("vLLM cannot serve")
    assert "\n" not in str(r.exception)                                       # one line at the CLI


def test_vllm_loader_rules(tmp_path):
    geo, eye = Geometry(3, 2, 8), torch.eye(8)

    def problems(obj):
        (tmp_path / "r.pt").write_bytes(save_bytes(obj))
        return vllm_load_problems(tmp_path / "r.pt", geo)

    assert problems({"layers": {0: {"rotation": eye}, "1": eye, 2: {"rotation": eye}}}) == []   # entry or tensor
    assert problems({0: eye, 1: eye, 2: eye}) == []                                          # flat dict
    assert problems(torch.stack([eye] * 3)) == []                                            # stacked [L, d, d]
    assert "silently serve them with the identity" in problems({"layers": {0: eye, 2: eye}})[0]
    assert "shape [2, 8, 8]" in problems({"layers": {i: eye.expand(2, 8, 8).clone() for i in range(3)}})[0]
    assert "not an integer" in problems({"layers": {"a": eye}})[0]
    assert "not orthogonal" in problems({i: 2 * eye for i in range(3)})[0]
    assert "stacked" in problems([eye])[0]


def test_vllm_round_trip_through_import(tmp_path):
    export_artifact(SMOL, tmp_path / "vllm", "vllm")
    import_files("vllm", [tmp_path / "vllm" / "k_rotation.pt", tmp_path / "vllm" / "v_rotation.pt"],
                 zoo_target(SMOL), tmp_path / "art", clip=load_artifact(SMOL).shared_clips())
    assert validate_artifact(tmp_path / "art").ok
    art = load_artifact(tmp_path / "art")
    assert art.granularity == "layer" and art.metadata["model_fingerprint"] == load_artifact(SMOL).metadata[
        "model_fingerprint"]
    for which in ("k", "v"):
        for i, r in enumerate(shared(SMOL, which)):
            assert torch.equal(getattr(art.layers[i], f"{which}_rotation"), r.expand(3, 64, 64))
    export_artifact(tmp_path / "art", tmp_path / "again", "vllm")               # and back out, the same bytes
    for f in ("k_rotation.pt", "v_rotation.pt"):
        a = parse_checkpoint(torch.load(tmp_path / "vllm" / f, weights_only=True))
        b = parse_checkpoint(torch.load(tmp_path / "again" / f, weights_only=True))
        assert all(torch.equal(a[i], b[i]) for i in range(30))


def test_vllm_import_serves_a_missing_layer_as_identity(tmp_path):
    rots = shared(SMOL, "k")
    (tmp_path / "k.pt").write_bytes(save_bytes({"layers": {i: {"rotation": rots[i]} for i in range(30) if i != 7}}))
    (tmp_path / "v.pt").write_bytes(save_bytes({i: r for i, r in enumerate(shared(SMOL, "v"))}))
    res = import_files("vllm", [tmp_path / "k.pt", tmp_path / "v.pt"], zoo_target(SMOL), tmp_path / "art")
    art = load_artifact(tmp_path / "art")
    assert torch.equal(art.layers[7].k_rotation[0], torch.eye(64)) and torch.equal(art.layers[8].k_rotation[0], rots[8])
    assert "identity, as vLLM serves them" in res.report["imported"]["k"]["notes"][0]
    assert "identity" in (tmp_path / "art" / "README.md").read_text()


# ----------------------------------------------------------------------------- llama.cpp

def test_llamacpp_bakes_into_a_copy_of_the_gguf(tmp_path):
    src = write_gguf(tmp_path / "qwen3-tiny.gguf")
    before = sha(src)
    res = export_artifact(SMOL, tmp_path / "out", "llamacpp", ExportSettings(gguf=src))
    assert sha(src) == before                                                      # never in place
    out = tmp_path / "out" / "qwen3-tiny-oscar.gguf"
    assert res.files[0] == out.name and gguf_load_problems(out, Geometry(30, 3, 64)) == []
    from gguf import GGUFReader

    new, old = GGUFReader(out), GGUFReader(src)
    tensors = {t.name: t for t in new.tensors}
    for t in old.tensors:                                                          # base tensors copied unchanged
        assert t.tensor_type == tensors[t.name].tensor_type and np.array_equal(t.data, tensors[t.name].data)
    assert new.get_field("general.name").contents() == "tiny test model"
    assert new.get_field("general.architecture").contents() == "qwen3"
    for which in ("k", "v"):
        for i, r in enumerate(shared(SMOL, which)):
            t = tensors[rot_name(which, i)]
            assert t.tensor_type.name == "F32" and np.array_equal(t.data, r.numpy().T)   # stored transposed
    env = res.launch.env
    assert env == {"LLAMA_KV_NO_HADAMARD": "1", "LLAMA_KV_CLIP_RATIO": "0.92", "LLAMA_KV_HP_SINK": "64",
                   "LLAMA_KV_HP_RECENT": "256"}
    assert res.launch.argv[res.launch.argv.index("--cache-type-k") + 1] == "q2_0"
    assert any("ONE clip ratio" in w for w in res.warnings)                        # K's 0.92 for V's 0.9
    # the round trip: import the GGUF, the same rotations
    imp = import_files("llamacpp", [out], zoo_target(SMOL), tmp_path / "art")
    art = load_artifact(tmp_path / "art")
    assert imp.report["imported"]["k"]["format_version"] == "gguf-f32-transposed"
    for which in ("k", "v"):
        for i, r in enumerate(shared(SMOL, which)):
            assert torch.equal(getattr(art.layers[i], f"{which}_rotation")[0], r)


def test_llamacpp_refusals(tmp_path):
    src = write_gguf(tmp_path / "llama.gguf", arch="llama")
    with pytest.raises(ArtifactError, match="'llama' model, and the fork's loader creates attn_k_rot/attn_v_rot only"):
        export_artifact(SMOL, tmp_path / "a", "llamacpp", ExportSettings(gguf=src))
    with pytest.raises(ArtifactError, match=r"num_kv_heads 2 \(artifact: 3\)"):
        export_artifact(SMOL, tmp_path / "b", "llamacpp", ExportSettings(gguf=write_gguf(tmp_path / "q.gguf", kv=2)))
    with pytest.raises(ArtifactError, match="sliding-window"):
        export_artifact(GEMMA, tmp_path / "c", "llamacpp",
                        ExportSettings(gguf=write_gguf(tmp_path / "g.gguf", layers=18, heads=4, kv=1, d=256)))
    baked = write_gguf(tmp_path / "baked.gguf", extra={"blk.0.attn_k_rot.weight": np.eye(64, dtype=np.float32)})
    with pytest.raises(ArtifactError, match="already holds OSCAR rotations"):
        export_artifact(SMOL, tmp_path / "d", "llamacpp", ExportSettings(gguf=baked))
    with pytest.raises(InputError, match="needs --gguf"):
        export_artifact(SMOL, tmp_path / "e", "llamacpp")
    assert not any((tmp_path / x).exists() for x in "abcde")


def test_llamacpp_loader_rules(tmp_path):
    geo, rng = Geometry(2, 1, 32), np.random.default_rng(1)
    r = [to_gguf(torch.linalg.qr(torch.randn(32, 32, dtype=torch.float64))[0].float()) for _ in range(2)]

    def problems(name, **kw):
        return gguf_load_problems(write_gguf(tmp_path / name, layers=2, heads=1, kv=1, d=32, **kw), geo)

    full = {rot_name(w, i): r[i] for w in ("k", "v") for i in range(2)}
    assert problems("ok.gguf", extra=full) == []
    assert problems("k_only.gguf", extra={rot_name("k", i): r[i] for i in range(2)}) == []   # V folded: none
    assert "no blk.1.attn_k_rot.weight" in problems("gap.gguf", extra={rot_name("k", 0): r[0]})[0]
    assert "attn_v_rot on 1 of 2 blocks" in problems("half_v.gguf", extra={**{rot_name("k", i): r[i] for i in
                                                                             range(2)}, rot_name("v", 0): r[0]})[0]
    assert "is F16 [32, 32]" in problems("f16.gguf", extra={**full, rot_name("k", 0): r[0].astype(np.float16)})[0]
    assert "not orthogonal" in problems("bad.gguf", extra={**full, rot_name("v", 1): 2 * r[1]})[0]
    assert "does not load attn_k_rot" in problems("llama.gguf", arch="llama", extra=full)[0]
    assert rng is not None


def test_llamacpp_folded_checkpoint_bakes_k_only(tmp_path):
    from oscar_calib.contract.artifact import write_artifact_files

    art = load_artifact(SMOL)
    art.metadata["v_folded"] = "true"
    (tmp_path / "folded").mkdir()
    write_artifact_files(tmp_path / "folded", art, "# folded\n", art.report)
    res = export_artifact(tmp_path / "folded", tmp_path / "out", "llamacpp",
                          ExportSettings(gguf=write_gguf(tmp_path / "m.gguf")))
    from gguf import GGUFReader

    names = {t.name for t in GGUFReader(tmp_path / "out" / res.files[0]).tensors}
    assert rot_name("k", 29) in names and not any("attn_v_rot" in n for n in names)
    imp = import_files("llamacpp", [tmp_path / "out" / res.files[0]], zoo_target(SMOL), tmp_path / "art")
    assert torch.equal(load_artifact(tmp_path / "art").layers[3].v_rotation[0], torch.eye(64))
    assert "folded" in imp.report["imported"]["v"]["notes"][0]


@pytest.mark.slow
def test_llamacpp_refuses_the_real_smollm2_gguf(tmp_path):
    from oscar_calib.model.source import resolve_model

    src = resolve_model("smollm2-135m")
    gguf = Path(src.path) / src.gguf_file
    with pytest.raises(ArtifactError, match="'llama' model"):
        export_artifact(SMOL, tmp_path / "out", "llamacpp", ExportSettings(gguf=gguf))


# ----------------------------------------------------------------------------- SGLang targets on the zoo

@pytest.mark.parametrize("target", ["sglang-fork", "sglang-fork-v2", "sglang"])
@pytest.mark.parametrize("zoo", [SMOL, GEMMA], ids=["smollm2", "gemma3"])
def test_sglang_exports_of_the_zoo_artifacts_pass_their_loaders(tmp_path, target, zoo):
    res = export_artifact(zoo, tmp_path / "out", target)
    art = load_artifact(zoo)
    geo = Geometry(art.num_layers, art.num_kv_heads, art.head_dim)
    assert TARGETS[target].load_problems(tmp_path / "out", geo) == []
    k = torch.load(tmp_path / "out" / res.files[0], weights_only=True)
    assert k["format_version"] == (2 if target == "sglang-fork-v2" else 1)
    imp = import_files(target, [tmp_path / "out" / f for f in res.files[:2]], zoo_target(zoo), tmp_path / "art",
                       clip=art.shared_clips())
    back = load_artifact(tmp_path / "art")
    for which in ("k", "v"):
        for i, lr in enumerate(art.layers):
            want = getattr(lr, f"{which}_rotation") if target == "sglang-fork-v2" else \
                art.shared_rotation(i, which)[0].expand(art.num_kv_heads, -1, -1)
            assert torch.equal(getattr(back.layers[i], f"{which}_rotation"), want)
    assert imp.report["imported"]["engine"] == TARGETS[target].engine


def test_fork_v2_loader_rules(tmp_path):
    d, h, eye = 8, 2, torch.eye(8)
    per = eye.expand(h, d, d).clone()

    def problems(layers, ids=None):
        (tmp_path / "f.pt").write_bytes(save_bytes({"format_version": 2, "layers": layers}))
        return fork_load_problems(tmp_path / "f.pt", num_layers=2, head_dim=d, target="sglang-fork-v2",
                                  num_kv_heads=h, layer_ids=ids)

    assert problems({0: {"rotation": per}, 1: {"rotation": eye}}) == []            # V2 and V1 entries mix
    assert problems({3: {"rotation": per}, 7: {"rotation": per}}, ids=(3, 7)) == []     # sparse global ids
    assert "no rotation for layer(s) 3, 7" in problems({0: {"rotation": per}, 1: {"rotation": per}}, ids=(3, 7))[0]
    assert "shape [3, 8, 8]" in problems({i: {"rotation": eye.expand(3, d, d).clone()} for i in range(2)})[0]
    assert "on 1 of 2 layers" in problems({0: {"rotation": per, "k_mean": torch.zeros(d)}, 1: {"rotation": per}})[0]
    assert "'q_rotation' has shape [8]" in problems({i: {"rotation": per, "q_rotation": torch.zeros(d)}
                                                     for i in range(2)})[0]
    assert problems({i: {"rotation": per, "k_mean": torch.zeros(h, d), "o_rotation": per} for i in range(2)}) == []


# ----------------------------------------------------------------------------- ONNX Runtime

@pytest.mark.parametrize("zoo", [SMOL, GEMMA], ids=["smollm2", "gemma3"])
def test_onnxruntime_bundle_of_the_zoo_artifacts(tmp_path, zoo):
    from safetensors.torch import load_file

    from oscar_calib.tools.export.onnxruntime import packed_head_size, rot_key

    res = export_artifact(zoo, tmp_path / "ort", "onnxruntime")
    art = load_artifact(zoo)
    geo = Geometry(art.num_layers, art.num_kv_heads, art.head_dim)
    assert sorted(res.files) == ["mpgqa_nodes.json", "oscar_rotations.safetensors", "settings.json"]
    assert TARGETS["onnxruntime"].load_problems(tmp_path / "ort", geo) == []
    tensors = load_file(str(tmp_path / "ort" / "oscar_rotations.safetensors"))
    nodes = json.loads((tmp_path / "ort" / "mpgqa_nodes.json").read_text())["nodes"]
    for i, lr in enumerate(art.layers):
        assert torch.equal(tensors[rot_key("k", i)], lr.k_rotation)           # per KV head, (H_kv, D, D), x @ R
        a = nodes[i]["attributes"]
        assert a["kv_quant_group_size"] == art.settings.k_groups[i]            # per-layer group sizes kept
        assert nodes[i]["kv_cache"]["packed_head_size"] == packed_head_size(art.head_dim, art.settings.k_groups[i])
        assert (a["sink_size"], a["recent_size"], a["cache_format_version"]) == (64, 256, 1)
    assert packed_head_size(128, 64) == 48 and packed_head_size(128, 64, "fp16") == 40   # the guide's worked example
    imp = import_files("onnxruntime", [tmp_path / "ort" / "oscar_rotations.safetensors"], zoo_target(zoo),
                       tmp_path / "art")
    back = load_artifact(tmp_path / "art")
    assert all(torch.equal(b.v_rotation, a.v_rotation) for a, b in zip(art.layers, back.layers))
    assert imp.report["imported"]["engine"] == "ONNX Runtime"


def test_onnxruntime_rules(tmp_path):
    with pytest.raises(ArtifactError, match="sink_size == recent_size == 0"):
        export_artifact(SMOL, tmp_path / "a", "onnxruntime", ExportSettings(sink=0, recent=0))
    export_artifact(SMOL, tmp_path / "ok", "onnxruntime")
    doc_path = tmp_path / "ok" / "mpgqa_nodes.json"
    doc = json.loads(doc_path.read_text())
    doc["nodes"][3]["attributes"].update(kv_quant_group_size=48, k_quant_rho=1.5)
    doc_path.write_text(json.dumps(doc))
    problems = TARGETS["onnxruntime"].load_problems(tmp_path / "ok", Geometry(30, 3, 64))
    assert "node 3: kv_quant_group_size 48 must divide head_dim 64" in problems[0]
    assert "node 3: k_quant_rho 1.5" in problems[1]


# ----------------------------------------------------------------------------- mlx-lm (closed pull request)

@pytest.mark.parametrize("zoo", [SMOL, GEMMA], ids=["smollm2", "gemma3"])
def test_mlx_export_round_trip_and_orientation(tmp_path, zoo):
    from safetensors.torch import load_file

    res = export_artifact(zoo, tmp_path / "mlx", "mlx-lm")
    art = load_artifact(zoo)
    geo = Geometry(art.num_layers, art.num_kv_heads, art.head_dim)
    assert TARGETS["mlx-lm"].load_problems(tmp_path / "mlx", geo) == []
    k = load_file(str(tmp_path / "mlx" / "k_rotation.safetensors"))
    x = torch.randn(5, art.head_dim, dtype=torch.float64)
    stored = k["layer_3"].double()
    stored = stored if stored.dim() == 2 else stored[0]
    want = art.layers[3].k_rotation[0].double()
    assert torch.allclose(x @ stored.transpose(-1, -2), x @ want, atol=1e-5)   # mlx: x @ Mᵀ = x @ R
    config = json.loads((tmp_path / "mlx" / "oscar_config.json").read_text())
    assert config["group_size"] == art.group_size and config["k_clip_ratio"] == art.shared_clips()[0]
    assert any("per INT2 group" in w for w in res.warnings)
    import_files("mlx-lm", [tmp_path / "mlx" / "k_rotation.safetensors", tmp_path / "mlx" / "v_rotation.safetensors"],
                 zoo_target(zoo), tmp_path / "art")
    back = load_artifact(tmp_path / "art")
    assert all(torch.equal(b.k_rotation, a.k_rotation) for a, b in zip(art.layers, back.layers))


def test_mlx_loader_rules(tmp_path):
    from oscar_calib.contract import stfile
    from oscar_calib.contract.artifact import tensor_entries
    from oscar_calib.tools.export.mlx import read_mlx_file

    geo, eye = Geometry(2, 2, 8), torch.eye(8)

    def read(tensors):
        (tmp_path / "k.safetensors").write_bytes(stfile.serialize(tensor_entries(tensors), {}))
        return read_mlx_file(tmp_path / "k.safetensors", geo)

    assert len(read({"layer_4": eye, "layer_9": eye}).rotations) == 2           # as many keys as layers: in order
    with pytest.raises(ArtifactError, match="no layer_1"):
        read({"layer_0": eye, "layer_2": eye, "layer_5": eye})
    with pytest.raises(ArtifactError, match=r"shape \[3, 8, 8\]"):
        read({"layer_0": eye, "layer_1": eye.expand(3, 8, 8).contiguous()})


# ----------------------------------------------------------------------------- conventions, numerically

def ggml_mul_mat(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """ggml's ``mul_mat(a, b)`` in numpy's (reversed) axis order: ``result[i, j] = Σ_k a[j, k]·b[i, k]``
    (ggml.h: a is [K, M], b is [K, N], the result [M, N] in ne order)."""
    return np.einsum("jk,ik->ij", a, b)


def test_llamacpp_orientation_is_x_at_r():
    g = torch.Generator().manual_seed(0)
    r = torch.linalg.qr(torch.randn(64, 64, generator=g, dtype=torch.float64))[0]
    q, k = torch.randn(5, 64, dtype=torch.float64, generator=g), torch.randn(7, 64, dtype=torch.float64, generator=g)
    stored = to_gguf(r.float()).astype(np.float64)
    k_rot = ggml_mul_mat(stored, k.numpy())                        # qwen3.cpp: ggml_mul_mat(attn_k_rot, Kcur)
    assert np.allclose(k_rot, (k @ r).numpy(), atol=1e-6)          # = K @ R, oscar's convention
    assert not np.allclose(k_rot, (k @ r.T).numpy(), atol=1e-2)
    assert np.allclose(ggml_mul_mat(stored, q.numpy()) @ k_rot.T, (q @ k.T).numpy(), atol=1e-5)   # scores kept
    o_rot = (k @ r).numpy()                                        # an attention output in the rotated basis
    assert np.allclose(ggml_mul_mat(stored.T.copy(), o_rot), k.numpy(), atol=1e-6)   # Mv = transpose(rot): o @ Rᵀ
    assert torch.equal(from_gguf(to_gguf(r.float())), r.float())


def test_vllm_orientation_is_k_at_r(tmp_path):
    rots = shared(SMOL, "k")
    export_artifact(SMOL, tmp_path / "v", "vllm")
    table = parse_checkpoint(torch.load(tmp_path / "v" / "k_rotation.pt", weights_only=True))
    e0 = torch.zeros(64)
    e0[0] = 1
    k = e0 @ rots[5].T                                             # the key whose rotated form is e0
    assert torch.allclose(k @ table[5], e0, atol=1e-5)             # vLLM: k_rot = k @ R
    assert not torch.allclose(k @ table[5].T, e0, atol=1e-2)


def test_clip_index_rule_and_quantile_are_one_order_statistic_apart():
    """oscar, the fork, vLLM's readable revisions and llama.cpp take sorted(|x|)[min(floor(c·d), d-1)];
    torch.quantile (the rule the issue reports for one vLLM revision) interpolates at c·(d-1): the two
    thresholds lie between the same or adjacent order statistics."""
    g = torch.Generator().manual_seed(0)
    for d in (64, 128, 256):
        x = torch.randn(200, d, generator=g)
        srt = x.abs().sort(-1).values
        for c in (0.9, 0.92, 0.96):
            idx = clip_threshold(x, c)[:, 0]
            assert torch.equal(idx, srt[:, min(int(c * d), d - 1)])
            quant = torch.quantile(x.abs(), c, dim=-1)
            lo = srt[:, int(c * (d - 1))]
            assert (quant >= lo - 1e-6).all() and (int(c * d) - int(c * (d - 1))) in (0, 1)
            assert (idx >= lo).all() and (quant <= srt[:, min(int(c * (d - 1)) + 1, d - 1)] + 1e-6).all()


def test_global_layer_ids_and_native_layers():
    from oscar_calib.numerics.engines import boundary_layers
    from oscar_calib.runtime.scheme import KVScheme

    assert boundary_layers(30) == [0, 1, 28, 29] and boundary_layers(3) == [0, 2] and boundary_layers(1) == []
    sch = KVScheme.engine_from_artifact(SMOL, "vllm")
    assert sch.native_layers == (0, 1, 28, 29) and (sch.sink, sch.recent) == (0, 0)
    assert not sch.quantizes(0) and sch.quantizes(2) and sch.layer_bits(0) == 16 and sch.layer_bits(2) == 2.5
    # a file keyed 1..30 (local ids shifted by one) is not what vLLM looks up for layers 0..29
    rots = shared(SMOL, "k")
    obj = payload(rots, [None] * 30, objective="x")
    obj["layers"] = {i + 1: e for i, e in obj["layers"].items()}
    table = parse_checkpoint(obj)
    assert 0 not in table and torch.equal(table[1], rots[0])


# ----------------------------------------------------------------------------- pull of V2 per-head files

def test_pull_reads_v2_per_head_files(monkeypatch, tmp_path):
    from oscar_calib.tools import rotationzoo

    monkeypatch.setenv("OSCAR_CACHE", str(tmp_path / "cache"))
    g = torch.Generator().manual_seed(3)
    heads = torch.linalg.qr(torch.randn(8, 128, 128, generator=g, dtype=torch.float64))[0].float()
    per_head = [heads.roll(i, 0) for i in range(36)]
    files = {"Qwen3-8B/k_rotation_perhead.pt": per_head, "Qwen3-8B/v_rotation_perhead.pt": per_head,
             "Qwen3-8B/k_rotation_qqt_r_h_pbr.pt": [r[0] for r in per_head],
             "Qwen3-8B/v_rotation_sst_r_h_pbr.pt": [r[0] for r in per_head]}

    def download(repo, name, revision, local_dir):
        p = Path(local_dir) / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(save_bytes(payload(files[name], [None] * 36, objective="perhead")))
        return p

    monkeypatch.setattr(rotationzoo, "list_repo_files", lambda repo, rev: list(files))
    monkeypatch.setattr(rotationzoo, "download_file", download)
    monkeypatch.setattr(rotationzoo, "_target", lambda cfg, model, trust: ModelTarget(
        "Qwen/Qwen3-8B", "qwen3", "0" * 64, 36, 32, 8, 128))           # its configs/ geometry, no meta model
    pulled = rotationzoo.pull_rotationzoo("qwen3-8b", out=tmp_path / "art")
    assert pulled.source["k_file"] == "Qwen3-8B/k_rotation_perhead.pt"             # V2 preferred over V1
    art = load_artifact(tmp_path / "art")
    assert art.granularity == "head" and torch.equal(art.layers[5].k_rotation, per_head[5])
    assert pulled.result.report["imported"]["k"]["format_version"] == "2"


# ----------------------------------------------------------------------------- the zoo card's engine section

def test_serving_table_and_the_engine_cost_section(tmp_path):
    import shutil

    from oscar_calib.eval.report import EvalResult, record_eval
    from oscar_calib.tools.export import serving_table

    rows = {r["target"]: r for r in serving_table(SMOL)}
    assert set(rows) == set(TARGETS)
    assert rows["vllm"]["argv"][:2] == ["vllm", "serve"] and rows["vllm"]["env"]["VLLM_OSCAR_K_ROTATION_PATH"] == \
        "serve/vllm/k_rotation.pt"
    assert "'llama'" in rows["llamacpp"]["refused"] and "--gguf <model>.gguf" in rows["llamacpp"]["export"]
    assert rows["onnxruntime"]["argv"] == [] and rows["sglang-fork"]["checked"].endswith("473ff3f9d")
    art = tmp_path / "smol"
    shutil.copytree(SMOL, art)
    before = json.loads((art / "calibration.json").read_text())["eval_results"]["ppl"]
    ppl = {"bf16": 8.2, "oscar": 8.4, "fork": 8.5, "vllm": 20.0, "llamacpp": 9.0}
    result = EvalResult("ppl", "HuggingFaceTB/SmolLM2-135M-Instruct",
                        {"sequences": 2, "seq_len": 2048, "data": "test text", "sink": 64, "recent": 256,
                         "engines": {"vllm": {}}},
                        [{"method": m, "ppl": p, "bits_per_element": 3.0} for m, p in ppl.items()], {})
    record_eval(art, result, serving=list(rows.values()))
    report = json.loads((art / "calibration.json").read_text())
    assert report["eval_results"]["ppl"] == before                     # the main table is kept
    assert report["eval_results"]["engines"]["rows"][3]["method"] == "vllm"
    card = (art / "README.md").read_text()
    section = card[card.index("## What each engine costs"):card.index("## Use")]
    assert "| 20.000 | +138.1% |" in section and "| 9.000 | +7.1% |" in section
    assert "refused: its GGUF architecture is 'llama'" in section
    assert "vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --kv-cache-dtype oscar_int2" in section
    assert "FutureMLS-Lab/OSCAR (branch zhongzhu/llamacpp) @ 4570ea609" in section
    from oscar_calib.contract.card import model_card

    assert card == model_card(report)          # the card of the stored report: validate sees it unedited
    # a run with every method of the main table as well fills both tables
    main = {r["method"]: r for r in before["rows"]}
    both = EvalResult("ppl", "HuggingFaceTB/SmolLM2-135M-Instruct", dict(before["settings"], methods=[*main, "vllm"]),
                      [*({**r, "ppl": r["ppl"] + 1.0} for r in main.values()),
                       {"method": "vllm", "ppl": 20.0, "bits_per_element": 5.0}], {})
    record_eval(art, both)
    report = json.loads((art / "calibration.json").read_text())
    assert [r["method"] for r in report["eval_results"]["ppl"]["rows"]] == list(main)
    assert report["eval_results"]["ppl"]["rows"][0]["ppl"] == main["bf16"]["ppl"] + 1.0
    assert report["eval_results"]["engines"]["rows"][-1]["method"] == "vllm"
    assert "vllm" not in report["eval_results"]["ppl"]["settings"]["methods"]


# ----------------------------------------------------------------------------- hybrids and mixed head sizes

def _stand_in_artifact(tmp_path: Path, family: str, granularity: str = "head") -> tuple[object, Path]:
    from factories import family_model, make_artifact

    model = family_model(family)
    return model, make_artifact(tmp_path / family, model, granularity=granularity,
                                metadata={"fork_k_clip": "0.96", "fork_v_clip": "0.92"})


def test_a_hybrids_rotations_keep_the_models_layer_ids(tmp_path):
    """A Qwen3.5 stand-in (linear, full, linear, full): the engines that number layers globally get
    its rotations at decoder layers 1 and 3, as the fork's Qwen3.5 recipe keys them (its branch
    zhongzhu/hybrid-model at 797e39c7c) and vLLM looks them up (layer_index_from_name at 40fa486ee);
    the same file read at 0..1 would leave those layers unrotated. ``oscar import`` reads them back
    by the same ids; the engines that cannot map them refuse in one line."""
    from oscar_calib.model.geometry import geometry_of, model_fingerprint

    model, path = _stand_in_artifact(tmp_path, "qwen3_5_text", "layer")
    art = load_artifact(path)
    geo = Geometry.of(art)
    assert geo.layer_ids == (1, 3)
    v2 = export_artifact(path, tmp_path / "v2", "sglang-fork-v2")
    k_file = tmp_path / "v2" / v2.files[0]
    k = torch.load(k_file, weights_only=True)
    assert sorted(k["layers"]) == [1, 3] and [e["layer_id"] for e in k["layers"].values()] == [1, 3]
    assert torch.equal(k["layers"][3]["rotation"], art.layers[1].k_rotation)
    assert fork_load_problems(k_file, num_layers=2, head_dim=16, target="sglang-fork-v2", num_kv_heads=2,
                              layer_ids=(1, 3)) == []
    assert "no rotation for layer(s) 0" in fork_load_problems(k_file, num_layers=2, head_dim=16,
                                                              target="sglang-fork-v2", num_kv_heads=2)[0]
    vl = export_artifact(path, tmp_path / "vllm", "vllm")
    table = parse_checkpoint(torch.load(tmp_path / "vllm" / vl.files[0], weights_only=True))
    assert sorted(table) == [1, 3] and vl.settings["native_layers"] == []       # none on a hybrid (9195dd08f3)
    assert vllm_load_problems(tmp_path / "vllm" / vl.files[0], geo) == []
    assert "no rotation for layer(s) [0]" in vllm_load_problems(tmp_path / "vllm" / vl.files[0],
                                                                Geometry(2, 2, 16))[0]
    target = ModelTarget.from_geometry("tiny-qwen3_5", geometry_of(model), model_fingerprint(model))
    back = import_files("vllm", [tmp_path / "vllm" / f for f in vl.files[:2]], target, tmp_path / "back").artifact
    assert back.settings.layer_ids == (1, 3)
    assert all(torch.equal(back.layers[i].k_rotation[0], art.shared_rotation(i, "k")[0]) for i in range(2))
    onnx = export_artifact(path, tmp_path / "onnx", "onnxruntime")
    nodes = json.loads((tmp_path / "onnx" / onnx.files[1]).read_text())["nodes"]
    assert [(n["layer"], n["model_layer"]) for n in nodes] == [(0, 1), (1, 3)]
    for name, why in (("sglang-fork", "HybridLinearKVPool"), ("sglang", "contiguous layer range"),
                      ("mlx-lm", "load_rotations numbers layer_<i>")):
        with pytest.raises(ArtifactError, match=why) as e:
            export_artifact(path, tmp_path / name, name)
        assert "\n" not in str(e.value) and not (tmp_path / name).exists()


def test_per_layer_head_sizes_reach_the_engines_that_load_them(tmp_path):
    """A Gemma 4 stand-in (sliding layers 2 KV heads of 16, a global layer 1 KV head of 32): the
    fork's newer loader takes one head_dim per layer (load_oscar_rotations at 8dbf789065), mlx-lm
    each layer's own square rotation; engines of one head geometry refuse in one line."""
    _, path = _stand_in_artifact(tmp_path, "gemma4")
    v2 = export_artifact(path, tmp_path / "v2", "sglang-fork-v2")
    k = torch.load(tmp_path / "v2" / v2.files[0], weights_only=True)
    assert [tuple(k["layers"][i]["rotation"].shape) for i in range(3)] == [(2, 16, 16), (2, 16, 16), (1, 32, 32)]
    assert "layer 2 rotation has shape [1, 32, 32]" in fork_load_problems(
        tmp_path / "v2" / v2.files[0], num_layers=3, head_dim=16, target="sglang-fork-v2", num_kv_heads=2)[0]
    export_artifact(path, tmp_path / "mlx", "mlx-lm")
    from safetensors.torch import load_file

    assert tuple(load_file(str(tmp_path / "mlx" / "k_rotation.safetensors"))["layer_2"].shape) == (1, 32, 32)
    for name in ("sglang-fork", "vllm", "onnxruntime"):
        with pytest.raises(ArtifactError, match="layers differ in head geometry"):
            export_artifact(path, tmp_path / name, name)
