"""Serving in the OSCAR SGLang fork: export (the files its loader accepts, its real settings),
import (every file it loads), and the V-rotation rule for folded checkpoints, proven with a
pure-torch simulation of the fork's data path."""

from __future__ import annotations

import copy
import json
import os
import stat
from pathlib import Path

import pytest
import torch
from factories import (
    assert_one_line_error,
    loaded_tiny,
    make_artifact,
    oscar,
    random_rotation,
    tiny_model,
)

import oscar_calib.model.load as models
from oscar_calib.contract.artifact import (
    WEIGHTS_NAME,
    Artifact,
    LayerRotations,
    load_artifact,
)
from oscar_calib.errors import ArtifactError, InputError, OutputExistsError
from oscar_calib.model.load import LoadedModel
from oscar_calib.model.source import ModelSource
from oscar_calib.runtime.scheme import KVScheme
from oscar_calib.runtime.simulate import SimulatedKV
from oscar_calib.tools.export import import_files
from oscar_calib.tools.export.ptfile import identity_payload, payload
from oscar_calib.tools.export.sglang import (
    export_sglang,
    fork_load_problems,
    read_rotation_file,
)
from oscar_calib.tools.validate import validate_artifact

# Every variable the fork reads for OSCAR serving (its sglang/srt/environ.py), and only those.
FORK_ENV = {"SGLANG_ENABLE_MIXED_KV_WINDOWS", "SGLANG_OSCAR_K_ROTATION_PATH", "SGLANG_OSCAR_V_ROTATION_PATH",
            "SGLANG_OSCAR_K_CLIP_RATIO", "SGLANG_OSCAR_V_CLIP_RATIO", "SGLANG_OSCAR_ABSORB_V_ROTATION",
            "SGLANG_MIXED_KV_PREFIX_TOKENS", "SGLANG_MIXED_KV_RECENT_TOKENS", "SGLANG_MIXED_KV_HP_DTYPE",
            "SGLANG_MIXED_KV_SCALE_DTYPE", "SGLANG_LLOYD_MAX", "SGLANG_OSCAR_FUSED_ROTATE_CLIP_QUANT"}


def read_env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))


def save(path: Path, obj) -> Path:
    torch.save(obj, path)
    return path


def shared_artifact(out: Path, **kw) -> Path:
    """A per-head test artifact with global clips but no shared rotations (like one from before 0.2
    would have, plus the clips)."""
    return make_artifact(out, metadata={"fork_k_clip": "0.96", "fork_v_clip": "0.92", **kw.pop("metadata", {})}, **kw)


# ----------------------------------------------------------------------------- the fork's loader rules

def test_loader_rules(tmp_path):
    d, n = 16, 3
    eye = torch.eye(d)
    ok = save(tmp_path / "ok.pt", {"layers": {0: {"rotation": eye}, "1": {"rotation": eye}, 2: {"rotation": eye},
                                              7: {"rotation": eye}}})          # str keys, extra layer, no version
    assert fork_load_problems(ok, num_layers=n, head_dim=d) == []
    per_head = save(tmp_path / "h.pt", {"format_version": 2, "layers": {i: {"rotation": eye.expand(2, d, d).clone()}
                                                                         for i in range(n)}})
    problems = fork_load_problems(per_head, num_layers=n, head_dim=d)
    assert problems and "shape [2, 16, 16]" in problems[0] and "sglang-fork-v2" in problems[0]
    assert fork_load_problems(per_head, num_layers=n, head_dim=d, target="sglang-fork-v2", num_kv_heads=2) == []
    cases = {
        "missing": ({"layers": {0: {"rotation": eye}}}, "no rotation for layer(s) 1, 2"),
        "no_layers": ({"rotation": eye}, "needs a dict with a 'layers' mapping"),
        "no_rotation": ({"layers": {i: {"R": eye} for i in range(n)}}, "layer 0 has no 'rotation' tensor"),
        "wrong_d": ({"layers": {i: {"rotation": torch.eye(8)} for i in range(n)}}, "shape [8, 8]"),
        "not_orthogonal": ({"layers": {i: {"rotation": 1.1 * eye} for i in range(n)}}, "not orthogonal"),
        "nan": ({"layers": {i: {"rotation": eye * float("nan")} for i in range(n)}}, "not a finite"),
    }
    for name, (obj, expected) in cases.items():
        problems = fork_load_problems(save(tmp_path / f"{name}.pt", obj), num_layers=n, head_dim=d)
        assert problems and expected in problems[0], (name, problems)
    (tmp_path / "junk.pt").write_bytes(b"not a pickle")
    assert "torch.load(weights_only=True)" in fork_load_problems(tmp_path / "junk.pt", num_layers=n, head_dim=d)[0]


def test_payload_is_what_the_forks_writer_writes():
    gen = torch.Generator().manual_seed(0)
    rots = [random_rotation(1, 8, gen)[0] for _ in range(2)]
    eigs = [torch.tensor([8.0, 4, 2, 1, 0.5, 0.25, 0.1, 0.0]) for _ in range(2)]
    p = payload(rots, eigs, objective="ktk_r_h_pbr")
    assert (p["format_version"], p["objective"], p["source_grouping"]) == (1, "ktk_r_h_pbr", "layer")
    e = p["layers"][1]
    assert e["layer_id"] == 1 and e["rotation"].dtype == torch.float32 and e["rotation"].is_contiguous()
    assert torch.equal(e["rotation"], rots[1]) and e["eigenvalues"].tolist() == sorted(eigs[1].tolist())  # ascending
    assert identity_payload(3, 8)["layers"][2]["rotation"].equal(torch.eye(8))


# ----------------------------------------------------------------------------- export

def test_export_demo_artifact_for_fork_main(demo_artifact, tmp_path):
    out = tmp_path / "serve"
    result = oscar("export", str(demo_artifact), "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    art = load_artifact(demo_artifact)
    k_name, v_name = "k_rotation_ktk_r_h_pbr.pt", "v_rotation_sst_r_h_pbr.pt"
    assert sorted(p.name for p in out.iterdir()) == sorted([k_name, v_name, "serve.env", "launch.sh", "clips.json"])
    for name in (k_name, v_name):
        assert fork_load_problems(out / name, num_layers=30, head_dim=64) == []
    k = torch.load(out / k_name, weights_only=True)
    for i in (0, 29):
        assert torch.equal(k["layers"][i]["rotation"], art.layers[i].k_layer_rotation)
    env = read_env(out / "serve.env")
    assert set(env) == FORK_ENV
    fk, fv = art.shared_clips()
    assert (float(env["SGLANG_OSCAR_K_CLIP_RATIO"]), float(env["SGLANG_OSCAR_V_CLIP_RATIO"])) == (fk, fv)
    assert env["SGLANG_ENABLE_MIXED_KV_WINDOWS"] == "1" and env["SGLANG_OSCAR_ABSORB_V_ROTATION"] == "0"  # llama
    assert (env["SGLANG_MIXED_KV_PREFIX_TOKENS"], env["SGLANG_MIXED_KV_RECENT_TOKENS"]) == ("64", "256")
    assert env["SGLANG_OSCAR_K_ROTATION_PATH"] == str((out / k_name).resolve())
    launch = (out / "launch.sh").read_text()
    assert os.stat(out / "launch.sh").st_mode & stat.S_IXUSR
    for flag in ("--kv-cache-dtype int2", "--kv-cache-quant-group-size 64", "--decode-attention-backend triton",
                 "--model-path \"$MODEL_PATH\"", "HuggingFaceTB/SmolLM2-135M-Instruct", "--page-size 8"):
        assert flag in launch
    assert doc["settings"]["k_clip"] == fk
    # the one setting the fork's main drops for this artifact, named in one line (a per-KV-head artifact)
    assert doc["warnings"] == [w for w in doc["warnings"] if "loads one rotation per layer" in w] and \
        len(doc["warnings"]) == 1


def test_export_v2_per_head_and_one_kv_head(demo_artifact, tmp_path):
    res = export_sglang(demo_artifact, tmp_path / "v2", target="sglang-fork-v2")
    k = torch.load(tmp_path / "v2" / res.files[0], weights_only=True)
    assert k["format_version"] == 2 and k["layers"][3]["rotation"].shape == (3, 64, 64)
    assert k["source_grouping"] == "per_kv_head" and "eigenvalues" not in k["layers"][3]    # its writer's form
    assert fork_load_problems(tmp_path / "v2" / res.files[0], num_layers=30, head_dim=64)   # main refuses it
    assert not fork_load_problems(tmp_path / "v2" / res.files[0], num_layers=30, head_dim=64,
                                  target="sglang-fork-v2", num_kv_heads=3)
    assert "per-head clip tables" in res.clip_source
    one = make_artifact(tmp_path / "one", kv=1, heads=4, d=16, metadata={"model_type": "qwen3"})
    res = export_sglang(one, tmp_path / "one_out", clip=(0.95, 0.9))
    v = torch.load(tmp_path / "one_out" / res.files[1], weights_only=True)
    assert v["layers"][0]["rotation"].shape == (16, 16)                 # one KV head: plain [d, d]
    assert read_env(tmp_path / "one_out" / "serve.env")["SGLANG_OSCAR_ABSORB_V_ROTATION"] == "1"   # qwen3 absorbs


def test_export_folded_checkpoint_serves_identity_v(tmp_path):
    art = shared_artifact(tmp_path / "ckpt" / "oscar", granularity="layer", d=16, metadata={"v_folded": "true"})
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    res = export_sglang(art, tmp_path / "serve")
    v = torch.load(tmp_path / "serve" / "v_rotation_identity.pt", weights_only=True)
    assert all(torch.equal(e["rotation"], torch.eye(16)) for e in v["layers"].values())
    env = read_env(tmp_path / "serve" / "serve.env")
    assert env["SGLANG_OSCAR_ABSORB_V_ROTATION"] == "0" and env["SGLANG_OSCAR_V_ROTATION_PATH"].endswith("identity.pt")
    assert res.settings.model_path == str((tmp_path / "ckpt").resolve())


def test_export_refusals_write_nothing(tmp_path):
    old = make_artifact(tmp_path / "old", d=16)                          # per head, no shared rotations or clips
    mixed = make_artifact(tmp_path / "mixed", d=16, mutate=lambda t: t["layers.0.k_clip"].fill_(0.8))
    with pytest.raises(ArtifactError, match="no global clip ratios recorded"):
        export_sglang(mixed, tmp_path / "out", target="sglang-fork-v2")
    cases = [
        (dict(), ArtifactError, "no shared per-layer rotations"),
        (dict(clip=(0.96, 1.5)), InputError, "outside (0, 1]"),
        (dict(clip=(0.96, 0.92), target="sglang-fork-v2", sink=60), InputError, "multiple of 8"),
        (dict(clip=(0.96, 0.92), target="sglang-fork-v2", recent=0), InputError, "at least 8"),
        (dict(target="nope"), InputError, "unknown --target"),
    ]
    for kw, err, msg in cases:
        with pytest.raises(err, match=msg.replace("(", r"\(").replace(")", r"\)")):
            export_sglang(old, tmp_path / "out", **kw)
    odd = shared_artifact(tmp_path / "odd", d=12, metadata={"group_size": "4"})
    assert validate_artifact(odd).ok
    with pytest.raises(ArtifactError, match="head_dim 12 is not a power of two"):
        export_sglang(odd, tmp_path / "out")
    result = oscar("export", str(old), "--out", str(tmp_path / "out"), "--clip", "k=0.9,v=0.9")
    assert_one_line_error(result.exit_code, result.stderr, "re-run `oscar calibrate`")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mixed", "odd", "old"]   # nothing written, no temporaries


def test_export_into_existing_directory_needs_overwrite(tmp_path):
    art = shared_artifact(tmp_path / "a", granularity="layer")
    out = tmp_path / "serve"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="pass --overwrite"):
        export_sglang(art, out)
    res = export_sglang(art, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == sorted([*res.files, "keep.txt"])


def test_sliding_window_model_is_exported_with_a_warning(tmp_path):
    art = shared_artifact(tmp_path / "g", kv=1, d=16, metadata={"model_type": "gemma3_text"})
    res = export_sglang(art, tmp_path / "serve")
    assert res.warnings and "sliding-window" in res.warnings[0]
    assert "# WARNING: " in (tmp_path / "serve" / "serve.env").read_text()


# ----------------------------------------------------------------------------- import

def tiny_target():
    model = tiny_model("llama")                        # 2 layers, 4 query / 2 KV heads, head_dim 16
    return LoadedModel.wrap(model, None, ModelSource("tiny", "test/tiny-llama", "", None, "local"))


def reference_pair(tmp_path: Path, **layer_extra) -> tuple[Path, Path, list]:
    """Files as the fork's writer lays them out: int keys, layer_id, objective, ascending eigenvalues."""
    gen = torch.Generator().manual_seed(3)
    rots = [random_rotation(1, 16, gen)[0] for _ in range(2)]
    eig = torch.arange(16.0)
    files = []
    for which in ("k", "v"):
        layers = {i: {"layer_id": i, "rotation": rots[i] if which == "k" else rots[1 - i], "eigenvalues": eig,
                      **layer_extra} for i in range(2)}
        files.append(save(tmp_path / f"{which}.pt", {"format_version": 1, "objective": f"{which}_r_h_pbr",
                                                     "source_grouping": "layer", "layers": layers}))
    return files[0], files[1], rots


def test_reference_pair_imports_to_identical_rotations_and_round_trips(tmp_path):
    k, v, rots = reference_pair(tmp_path)
    res = import_files("sglang-fork", [k, v], tiny_target(), tmp_path / "art", clip=(0.9, None))
    art = load_artifact(tmp_path / "art")
    assert art.metadata["granularity"] == "layer" and art.shared_clips() == (0.9, 0.92)
    for i in range(2):
        assert torch.equal(art.layers[i].k_rotation, rots[i].expand(2, 16, 16))
        assert torch.equal(art.layers[i].v_rotation[1], rots[1 - i])
        assert art.layers[i].k_eigenvalues[0].tolist() == sorted(range(16), reverse=True)
    assert res.report["imported"]["k"]["format_version"] == "1"
    out = export_sglang(tmp_path / "art", tmp_path / "serve")        # and back: the same matrices
    again = torch.load(tmp_path / "serve" / out.files[0], weights_only=True)
    assert all(torch.equal(again["layers"][i]["rotation"], rots[i]) for i in range(2))


def test_import_reads_what_the_fork_loads(tmp_path):
    eye = torch.eye(16)
    identity = {"format_version": "identity-v1", "layers": {str(i): {"layer_id": i, "rotation": eye} for i in range(2)}}
    extra = {"layers": {0: {"rotation": eye}, 1: {"rotation": eye}, 5: {"rotation": eye}}}     # no version, extra
    gen = torch.Generator().manual_seed(4)
    r16 = {"format_version": 1, "layers": {i: {"rotation": random_rotation(1, 16, gen)[0].to(torch.bfloat16)}
                                           for i in range(2)}}
    k, v, b = save(tmp_path / "k.pt", identity), save(tmp_path / "v.pt", extra), save(tmp_path / "b.pt", r16)
    f = read_rotation_file(v, num_layers=2, num_kv_heads=2, head_dim=16)
    assert f.format_version == "missing" and f.notes == ["layer(s) 5 ignored (not among the model's layers)"]
    f = read_rotation_file(b, num_layers=2, num_kv_heads=2, head_dim=16)
    assert f.source_dtype == "bfloat16" and "re-orthogonalised" in f.notes[0]
    assert float((f.rotations[0][0].double() @ f.rotations[0][0].double().T - torch.eye(16)).abs().max()) < 1e-5
    res = import_files("sglang-fork", [k, b], tiny_target(), tmp_path / "art")
    assert validate_artifact(tmp_path / "art").ok and res.report["imported"]["k"]["format_version"] == "identity-v1"
    assert "re-orthogonalised" in (tmp_path / "art" / "README.md").read_text()


def test_key_centering_round_trips_through_the_forks_newer_files(tmp_path):
    """sglang-fork-v2 writes every layer's k_mean into the K file (the fork's newer loader reads it
    there, on every layer or none, [d] or [h, d]); the fork's main does not read it, so its export
    says so; importing the V2 files gives the artifact's centering back."""
    art = make_artifact(tmp_path / "c", kv=2, heads=4, d=16, centered=True, granularity="layer",
                        metadata={"fork_k_clip": "0.95", "fork_v_clip": "0.9"})
    src = load_artifact(art)
    res = export_sglang(art, tmp_path / "v2", target="sglang-fork-v2")
    k = torch.load(tmp_path / "v2" / res.files[0], weights_only=True)
    v = torch.load(tmp_path / "v2" / res.files[1], weights_only=True)
    assert all(torch.equal(k["layers"][i]["k_mean"], src.layers[i].k_mean) for i in range(2))
    assert all("k_mean" not in e for e in v["layers"].values()) and not any("k_mean" in w for w in res.warnings)
    got = import_files("sglang-fork-v2", [tmp_path / "v2" / res.files[0], tmp_path / "v2" / res.files[1]],
                       tiny_target(), tmp_path / "back")
    back = load_artifact(tmp_path / "back")
    assert back.settings.key_centering and all(torch.equal(a.k_mean, b.k_mean) for a, b in zip(back.layers, src.layers))
    assert "key centering" in " ".join(got.report["imported"]["k"]["notes"])
    main = export_sglang(art, tmp_path / "v1", target="sglang-fork")
    assert any("does not subtract the mean key (k_mean)" in w for w in main.warnings)
    assert "k_mean" not in torch.load(tmp_path / "v1" / main.files[0], weights_only=True)["layers"][0]
    # the loader's rules on the field: every layer or none, [d] or [h, d], finite
    eye = torch.eye(16).expand(2, 16, 16).clone()
    cases = {"one_layer": ({0: {"rotation": eye, "k_mean": torch.zeros(2, 16)}, 1: {"rotation": eye}},
                           "'k_mean' is on 1 of 2 layers"),
             "wrong_heads": ({i: {"rotation": eye, "k_mean": torch.zeros(3, 16)} for i in range(2)},
                             "layer 0 'k_mean' has shape [3, 16]"),
             "nan": ({i: {"rotation": eye, "k_mean": torch.full((16,), float("nan"))} for i in range(2)},
                     "layer 0 'k_mean' is not a finite")}
    for name, (layers, line) in cases.items():
        f = save(tmp_path / f"{name}.pt", {"format_version": 2, "layers": layers})
        problems = fork_load_problems(f, num_layers=2, head_dim=16, target="sglang-fork-v2", num_kv_heads=2)
        assert problems and line in problems[0], (name, problems)
        with pytest.raises(ArtifactError, match=line.replace("[", r"\[").replace("]", r"\]")):
            read_rotation_file(f, num_layers=2, num_kv_heads=2, head_dim=16)
    shared = save(tmp_path / "d.pt", {"layers": {i: {"rotation": torch.eye(16), "k_mean": torch.ones(16)}
                                                 for i in range(2)}})
    assert read_rotation_file(shared, num_layers=2, num_kv_heads=2, head_dim=16).k_means[1].shape == (2, 16)
    q = save(tmp_path / "q.pt", {"layers": {i: {"rotation": torch.eye(16), "q_rotation": torch.eye(16)}
                                            for i in range(2)}})
    with pytest.raises(ArtifactError, match="'q_rotation' .* not imported"):
        read_rotation_file(q, num_layers=2, num_kv_heads=2, head_dim=16)


@pytest.mark.parametrize("name,obj,expected", [
    ("per_head_wrong_h", {"format_version": 2, "layers": {i: {"rotation": torch.eye(16).expand(3, 16, 16).clone()}
                                                          for i in range(2)}},
     "shape [3, 16, 16]; the model needs [16, 16] (one per layer) or [2, 16, 16]"),
    ("missing_layer", {"layers": {0: {"rotation": torch.eye(16)}}}, "no rotation for layer(s) 1"),
    ("not_orthogonal", {"layers": {i: {"rotation": 1.01 * torch.eye(16)} for i in range(2)}}, "not orthogonal"),
    ("bad_key", {"layers": {"first": {"rotation": torch.eye(16)}}}, "layer id 'first' is not an integer"),
    ("list", [torch.eye(16)], "holds list"),
])
def test_import_refuses_bad_files_and_writes_nothing(tmp_path, name, obj, expected):
    good = save(tmp_path / "V.pt", {"layers": {i: {"rotation": torch.eye(16)} for i in range(2)}})
    bad = save(tmp_path / "K.pt", obj)
    with pytest.raises(ArtifactError) as exc:
        import_files("sglang-fork", [bad, good], tiny_target(), tmp_path / "out")
    msg = str(exc.value)
    assert msg.startswith(f"{bad}: ") and expected in msg and "\n" not in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["K.pt", "V.pt"]


def test_import_cli_and_clip_refusal(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "load_model", lambda spec, **kw: tiny_target())
    k, v, _ = reference_pair(tmp_path)
    out = tmp_path / "art"
    result = oscar("import", str(k), str(v), "--model", "tiny", "--out", str(out), "--clip",
                   "k=0.5,v=1.5")
    assert_one_line_error(result.exit_code, result.stderr, "outside (0, 1]")
    assert not out.exists()
    result = oscar("import", str(k), str(v), "--model", "tiny", "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["granularity"] == "layer"
    before = (out / WEIGHTS_NAME).read_bytes()
    result = oscar("import", str(k), str(v), "--model", "tiny", "--out", str(out))
    assert_one_line_error(result.exit_code, result.stderr, "already holds an artifact")
    assert (out / WEIGHTS_NAME).read_bytes() == before


# ----------------------------------------------------------------------------- the fork's data path

def fork_artifact(model, seed: int = 5) -> Artifact:
    """A granularity-layer artifact for ``model`` (one rotation per layer, as the fork serves)."""
    from oscar_calib.model.geometry import geometry_of, model_fingerprint

    g = geometry_of(model)
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(g.num_layers):
        k, v = (random_rotation(1, g.head_dim, gen).expand(g.num_kv_heads, -1, -1).clone() for _ in range(2))
        e = torch.linspace(1, 0, g.head_dim).expand(g.num_kv_heads, -1).clone()
        layers.append(LayerRotations(k, v, torch.full((g.num_kv_heads,), 0.96), torch.full((g.num_kv_heads,), 0.92),
                                     e, e.clone()))
    md = {"num_layers": str(g.num_layers), "num_attention_heads": str(g.num_attention_heads), "model_id": "tiny",
          "num_kv_heads": str(g.num_kv_heads), "head_dim": str(g.head_dim), "group_size": "16", "granularity": "layer",
          "sink_tokens": "8", "recent_tokens": "8", "fork_k_clip": "0.96", "fork_v_clip": "0.92",
          "model_fingerprint": model_fingerprint(model)}
    return Artifact(layers=layers, metadata=md)


def absorb_v_rows(model, art: Artifact):
    """The fork's load-time absorption: R_v folded into the V rows of the projection only (o_proj untouched)."""
    m = copy.deepcopy(model)
    for layer, lr in zip(m.model.layers, art.layers):
        w = layer.self_attn.v_proj.weight
        h, d = lr.v_rotation.shape[:2]
        wv = w.view(h, d, -1)
        w.copy_(torch.einsum("hde,hdi->hei", lr.v_rotation.to(w.dtype), wv).reshape_as(w))
    return m


def logits_with(model, scheme, ids):
    with SimulatedKV(model, scheme):
        return model(input_ids=ids).logits


def test_folded_checkpoint_with_identity_v_equals_the_unfolded_model():
    """Three ways to serve the same artifact agree (within float32 rounding of the fold): the fork with
    R_v absorbed into the V rows and the output mapped back (o @ R_vᵀ); the fork on a `fold-weights`
    checkpoint with identity V; and oscar's own online V rotation. Giving the folded checkpoint the
    real R_v rotates V twice and is far off: that is why export writes identity V for it. (The BF16
    windows are kept exact here: rounding them in the rotated or the plain basis is a separate,
    tiny effect.)"""
    from oscar_calib.tools.fold import fold_v_rotation

    model = tiny_model("llama", layers=2)
    art = fork_artifact(model)
    ids = torch.randint(1, 120, (1, 48), generator=torch.Generator().manual_seed(0))
    online = logits_with(model, KVScheme.shared_from_artifact(art, bf16_rotations=False, window_dtype=None), ids)
    absorbed = logits_with(absorb_v_rows(model, art),
                           KVScheme.shared_from_artifact(art, absorb_v=True, bf16_rotations=False,
                                                                   window_dtype=None), ids)
    folded = copy.deepcopy(model)
    fold_v_rotation(folded, art)
    ident = KVScheme.shared_from_artifact(art, bf16_rotations=False, window_dtype=None)
    ident.v_rotation = [None] * ident.num_layers
    with_identity = logits_with(folded, ident, ids)
    twice = logits_with(folded, KVScheme.shared_from_artifact(art, bf16_rotations=False, window_dtype=None), ids)
    plain = model(input_ids=ids).logits
    scale = (online - plain).abs().max()
    assert scale > 1e-3                                         # quantisation is really on
    for other in (absorbed, with_identity):
        assert (other - online).abs().max() < 1e-3 * scale       # measured: 2e-7 against 0.035
    assert (twice - online).abs().max() > 0.5 * scale


# ----------------------------------------------------------------------------- calibration

def test_calibration_stores_shared_rotations_and_global_clips(tmp_path):
    from factories import FAST

    from oscar_calib.calibration.pipeline import calibrate
    from oscar_calib.contract.config import CalibrationConfig
    from oscar_calib.numerics.clip import CLIP_GRID
    from oscar_calib.numerics.rotation import rotations_from_covariance

    lm = loaded_tiny("llama")
    res = calibrate(CalibrationConfig(**{**FAST, "tokens": 512, "seq_len": 128, "heldout_tokens": 64}),
                    tmp_path / "a", loaded=lm)
    art = load_artifact(tmp_path / "a")
    assert validate_artifact(tmp_path / "a").ok
    k, v = art.shared_clips()
    assert k in CLIP_GRID and v in CLIP_GRID
    pooled, _ = rotations_from_covariance(res.stats.stats[1].covariance("k"), "u_h_pbr", "layer", warn=False)
    assert torch.allclose(art.layers[1].k_layer_rotation, pooled[0].float(), atol=1e-6)
    assert not torch.allclose(art.layers[1].k_rotation[0], art.layers[1].k_rotation[1])   # per head differs
    assert "mean_attn_error_fork" in res.report["summary"]
    assert all("fork" in row["heldout"] for row in res.report["layers"])


def test_per_layer_group_sizes_export_the_closest_uniform_scheme_with_one_line(tmp_path):
    """A bit-budget artifact (per-layer sizes): the fork takes one size, so the export serves the
    artifact's group_size and says so, with the held-out cost its calibration report recorded."""
    art = shared_artifact(tmp_path / "b", granularity="layer", d=16,
                          metadata={"layer_group_sizes": "16,4", "group_size": "8"})
    report = json.loads((art / "calibration.json").read_text())
    report["bit_budget"] = {"bits": 2.6, "heldout_attn": {"per_layer": 0.2, "uniform": 0.21}}
    (art / "calibration.json").write_text(json.dumps(report))
    res = export_sglang(art, tmp_path / "serve")
    assert res.settings.group_size == 8
    assert read_env(tmp_path / "serve" / "serve.env") and "--kv-cache-quant-group-size" in \
        (tmp_path / "serve" / "launch.sh").read_text()
    note = [w for w in res.warnings if "one group size" in w]
    assert len(note) == 1 and "\n" not in note[0]
    assert "exporting group 8 (6 bits per element)" in note[0] and "bit budget of 2.6" in note[0]
    assert "0.2100 with group 8 vs 0.2000 with the per-layer sizes (+5.0%)" in note[0]
    plain = shared_artifact(tmp_path / "p", granularity="layer", d=16)
    assert not [w for w in export_sglang(plain, tmp_path / "serve2").warnings if "one group size" in w]
    result = oscar("export", str(art), "--out", str(tmp_path / "serve3"))
    assert result.exit_code == 0 and "SGLang fork takes one group size for every layer" in result.output


def test_a_key_value_split_exports_the_closest_uniform_scheme_with_one_line(tmp_path):
    """Keys and values in groups of different sizes (``layer_v_group_sizes``): the fork takes one size
    for both caches, so the export serves ``group_size`` and its one line names both lists' ranges."""
    art = shared_artifact(tmp_path / "s", granularity="layer", d=16,
                          metadata={"layer_group_sizes": "4,4", "layer_v_group_sizes": "16,8", "group_size": "8"})
    res = export_sglang(art, tmp_path / "serve")
    assert res.settings.group_size == 8
    note = [w for w in res.warnings if "one group size" in w]
    assert len(note) == 1 and "\n" not in note[0]
    assert "the keys' per-layer sizes 4–4 and the values' 8–16" in note[0]
    assert "cost not recorded" in note[0]
    # the values alone apart from one uniform size: still one line
    only_v = shared_artifact(tmp_path / "v", granularity="layer", d=16,
                             metadata={"layer_v_group_sizes": "16,16", "group_size": "8"})
    assert [w for w in export_sglang(only_v, tmp_path / "serve2").warnings if "one group size" in w]
