"""oscar fold-weights: the value rotation folded into v_proj rows and o_proj columns.

Tiny random-init models cover the layouts (GQA, MHA, q/k norms, sliding windows, projection
biases, a fused qkv projection); the real SmolLM2 with a calibrated artifact is the end-to-end
test (fold, write, reload with plain transformers)."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
from pathlib import Path

import pytest
import torch
from factories import (
    ascii_tokenizer,
    assert_one_line_error,
    build_artifact,
    make_artifact,
    oscar,
    save_checkpoint,
    tiny_model,
)

from oscar_calib.contract.artifact import (
    WEIGHTS_NAME,
    load_artifact,
    read_metadata,
    write_artifact_files,
)
from oscar_calib.errors import (
    ArtifactError,
    NumericalError,
    OutputExistsError,
    UnsupportedModelError,
)
from oscar_calib.model.geometry import geometry_of, model_fingerprint
from oscar_calib.model.load import LoadedModel
from oscar_calib.model.source import ModelSource
from oscar_calib.numerics.quant import quantize_int2, simulate_kv_quant
from oscar_calib.tools.fold import (
    CHECK_TOLERANCE,
    fold_and_check,
    fold_checkpoint,
    fold_v_rotation,
    rel_diff,
    run_and_capture,
    sample_input_ids,
)

# ----------------------------------------------------------------------------- helpers


def randomise_biases(model, seed: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("bias") and "self_attn" in name:
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def phi3_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("phi3", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                               pad_token_id=0, bos_token_id=1, eos_token_id=1)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval().requires_grad_(False)


def make_model(kind: str):
    if kind == "phi3":
        return phi3_model()
    model = tiny_model(kind)
    if kind == "qwen2":
        randomise_biases(model)
    return model


def wrap(model, tokenizer=None) -> LoadedModel:
    """A model in memory as the LoadedModel that ``fold_checkpoint(loaded=...)`` takes."""
    return LoadedModel.wrap(model, tokenizer, ModelSource("tiny", "tiny", "", None, "local"))


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(root).rglob("*")) if p.is_file()}


def save_tiny(tmp_path: Path, kind: str = "llama") -> tuple[Path, object]:
    model = make_model(kind)
    return save_checkpoint(tmp_path / f"src-{kind}", model, ascii_tokenizer()), model


@contextlib.contextmanager
def v_int2(model, rotations: list[torch.Tensor] | None, group_size: int):
    """Simulate an INT2 value cache: every layer's V is rotated per KV head (unless
    ``rotations`` is None), fake-quantised with quant.simulate_kv_quant and rotated back."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = "oscar_test_v_int2"
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def attention(module, query, key, value, attention_mask, **kwargs):
        r = None if rotations is None else rotations[module.layer_idx]
        vq = simulate_kv_quant(value.transpose(1, 2), r, 1.0, group_size, unrotate=True)
        return sdpa(module, query, key, vq.transpose(1, 2).to(value.dtype), attention_mask, **kwargs)

    AttentionInterface.register(name, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    configs = {id(c): c for c in (model.config, model.config.get_text_config())}.values()
    saved = [(c, c._attn_implementation) for c in configs]
    for c, _ in saved:
        c._attn_implementation = name
    try:
        yield
    finally:
        for c, old in saved:
            c._attn_implementation = old


@torch.no_grad()
def logits(model, ids) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits.double()


def expected_values(values: dict, rotations: list[torch.Tensor]) -> dict:
    return {i: torch.einsum("bhtd,hde->bhte", v, rotations[i].double()) for i, v in values.items()}


def assert_fold_exact(original, folded, rotations, ids, group_size: int) -> dict:
    """Logits equal, values rotated per head, and INT2-V simulation equivalence."""
    lg0, v0 = run_and_capture(original, ids)
    lg1, v1 = run_and_capture(folded, ids)
    figures = {"logits": rel_diff(lg0, lg1)}
    want = expected_values(v0, rotations)
    figures["values"] = max(rel_diff(want[i], v1[i]) for i in want)
    assert set(v1) == set(range(len(rotations)))
    assert figures["logits"] <= CHECK_TOLERANCE, figures
    assert figures["values"] <= CHECK_TOLERANCE, figures
    # the folded model quantises v·R as produced: no rotation at run time
    with v_int2(original, rotations, group_size):
        sim_rotated = logits(original, ids)
    with v_int2(folded, None, group_size):
        sim_folded = logits(folded, ids)
    with v_int2(original, None, group_size):
        sim_plain = logits(original, ids)
    # the INT2 value caches themselves: same codes, scales and zeros, layer by layer
    codes = mismatched = 0
    for i, r in enumerate(rotations):
        qa, sa, za = quantize_int2(want[i].float(), group_size)
        qb, sb, zb = quantize_int2(v1[i].float(), group_size)
        codes, mismatched = codes + qa.numel(), mismatched + int((qa != qb).sum())
        assert rel_diff(sa, sb) <= CHECK_TOLERANCE
    figures["code_mismatch"] = mismatched / codes
    assert figures["code_mismatch"] <= 1e-4, figures
    # End to end. INT2 rounding is discontinuous: a value within ~1e-7 of a rounding boundary may
    # land on the other code (float32 rounding of the folded weights), and through many layers
    # such a flip grows; on these fixed inputs no code flips and the logits agree.
    figures["sim"] = rel_diff(sim_rotated, sim_folded)
    figures["sim_vs_unrotated"] = rel_diff(sim_rotated, sim_plain)
    assert figures["sim"] <= 1e-3, figures
    assert figures["sim_vs_unrotated"] > 30 * max(figures["sim"], 1e-6), figures   # the rotation does matter
    return figures


# ----------------------------------------------------------------------------- fold in memory


@pytest.mark.parametrize("kind", ["llama", "llama_mha", "qwen2", "qwen3", "gemma3", "phi3"])
def test_fold_is_exact_tiny(kind):
    model = make_model(kind)
    if kind == "qwen2":
        assert model.model.layers[0].self_attn.v_proj.bias.abs().min() > 0
    art = build_artifact(model)
    folded = copy.deepcopy(model)
    ids, _ = sample_input_ids(None, 128)
    check, _ = fold_and_check(folded, art, ids)
    assert check.ok and check.value_rel_err <= CHECK_TOLERANCE
    # the weights really changed (the test above would pass for a no-op only if R = I)
    attn0, attn1 = model.model.layers[0].self_attn, folded.model.layers[0].self_attn
    assert not torch.allclose(attn0.o_proj.weight, attn1.o_proj.weight)
    assert_fold_exact(model, folded, [layer.v_rotation for layer in art.layers], ids, 8)


def test_fold_math_per_head_tiny():
    """Check the weight formulas directly: W_v,h' = Rᵀ W_v,h, b_h' = b_h R, W_o[:, j]' = W_o[:, j] R[j // g]."""
    model = make_model("qwen2")
    art = build_artifact(model)
    folded = copy.deepcopy(model)
    fold_v_rotation(folded, art)
    geo = geometry_of(model)
    d, g = geo.head_dim, geo.group
    a0, a1, r = model.model.layers[1].self_attn, folded.model.layers[1].self_attn, art.layers[1].v_rotation.double()
    for h in range(geo.num_kv_heads):
        rows = slice(h * d, (h + 1) * d)
        torch.testing.assert_close(a1.v_proj.weight[rows].double(), r[h].T @ a0.v_proj.weight[rows].double(),
                                   rtol=0, atol=1e-6)
        torch.testing.assert_close(a1.v_proj.bias[rows].double(), a0.v_proj.bias[rows].double() @ r[h],
                                   rtol=0, atol=1e-6)
    for j in range(geo.num_attention_heads):
        cols = slice(j * d, (j + 1) * d)
        torch.testing.assert_close(a1.o_proj.weight[:, cols].double(), a0.o_proj.weight[:, cols].double() @ r[j // g],
                                   rtol=0, atol=1e-6)
    torch.testing.assert_close(a1.q_proj.weight, a0.q_proj.weight, rtol=0, atol=0)   # q and k untouched
    torch.testing.assert_close(a1.k_proj.weight, a0.k_proj.weight, rtol=0, atol=0)


def test_wrong_fold_is_caught(tmp_path, monkeypatch):
    """The proof refuses a fold that is wrong (R instead of Rᵀ on the V rows) and writes nothing."""
    import oscar_calib.tools.fold.weights as fold

    src, model = save_tiny(tmp_path)
    art_dir = tmp_path / "art"
    make_artifact(art_dir, model)
    orig = fold.fold_layer
    monkeypatch.setattr(fold, "fold_layer", lambda t, r, n: orig(t, r.transpose(-1, -2), n))
    out = tmp_path / "out"
    with pytest.raises(NumericalError, match="fold check failed"):
        fold_checkpoint(str(src), art_dir, out)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["art", "src-llama"]


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoint_sharded_reloads(tmp_path):
    from transformers import AutoModelForCausalLM

    src, model = save_tiny(tmp_path, "llama")
    art_dir = tmp_path / "art"
    make_artifact(art_dir, model, centered=True)            # key centering: k_mean stays online, in the copy
    before_src, before_art = tree_digest(src), tree_digest(art_dir)
    out = tmp_path / "out"
    res = fold_checkpoint(str(src), art_dir, out, shard_size="100KB")
    assert tree_digest(src) == before_src and tree_digest(art_dir) == before_art          # inputs untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "out", "src-llama"]     # no temp dirs left
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((out / s).exists() for s in shards) and res.report["shards"] == len(shards)
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "oscar/oscar.safetensors", "oscar/README.md", "oscar/calibration.json"):
        assert (out / f).exists(), f
    cfg = json.loads((out / "config.json").read_text())
    sha = hashlib.sha256((art_dir / WEIGHTS_NAME).read_bytes()).hexdigest()
    assert cfg["oscar"] == {**cfg["oscar"], "v_folded": True, "artifact_fingerprint": sha, "format_version": 1,
                            "model_fingerprint": model_fingerprint(model)}
    meta = read_metadata(out / "oscar")
    own = ("v_folded", "content_sha256")                     # the copy is other content: its own digest
    assert meta["v_folded"] == "true" and {k: v for k, v in meta.items() if k not in own} == \
        {k: v for k, v in read_metadata(art_dir).items() if k not in own}
    copy_ = load_artifact(out / "oscar")
    assert all(torch.equal(a.v_rotation, b.v_rotation) and torch.equal(a.k_mean, b.k_mean)
               for a, b in zip(copy_.layers, load_artifact(art_dir).layers))
    assert copy_.settings.key_centering and "`k_mean`" in (out / "oscar" / "README.md").read_text()

    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert reloaded.dtype == torch.float32
    assert model_fingerprint(reloaded) == model_fingerprint(model)
    ids, kind = sample_input_ids(ascii_tokenizer(), 128)
    assert kind == "embedded"
    assert rel_diff(logits(model, ids), logits(reloaded, ids)) <= CHECK_TOLERANCE
    r = res.report
    assert r["check"]["logits_rel_diff"] <= CHECK_TOLERANCE and r["check"]["value_rel_err"] <= CHECK_TOLERANCE
    assert r["reload"]["logits_rel_diff"] <= CHECK_TOLERANCE and r["check"]["input"] == "embedded"
    # folding the folded checkpoint again is refused (its config says so)
    with pytest.raises(ArtifactError, match="already folded"):
        fold_checkpoint(str(out), art_dir, tmp_path / "again")
    assert not (tmp_path / "again").exists()


def test_checkpoint_bf16_with_biases(tmp_path):
    from transformers import AutoModelForCausalLM

    src, model = save_tiny(tmp_path, "qwen2")
    art_dir = tmp_path / "art"
    make_artifact(art_dir, model)
    out = tmp_path / "out"
    res = fold_checkpoint(str(src), art_dir, out, dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.dtype == torch.bfloat16 and reloaded.model.layers[0].self_attn.v_proj.bias is not None
    from transformers import AutoTokenizer

    ids, _ = sample_input_ids(AutoTokenizer.from_pretrained(src), 128)      # the batch the library checked
    d = rel_diff(logits(model, ids), logits(reloaded.float(), ids))
    assert res.report["check"]["logits_rel_diff"] <= CHECK_TOLERANCE       # the float32 proof before casting
    assert d <= res.report["reload"]["tolerance"] and abs(d - res.report["reload"]["logits_rel_diff"]) < 1e-6
    assert res.report["dtype"] == "bfloat16" and res.report["input_dtype"] == "float32"


def test_output_rules(tmp_path):
    src, model = save_tiny(tmp_path)
    art_dir = tmp_path / "art"
    make_artifact(art_dir, model)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="--overwrite"):
        fold_checkpoint(str(src), art_dir, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    fold_checkpoint(str(src), art_dir, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "out", "src-llama"]
    with pytest.raises(Exception, match="overlaps an input"):
        fold_checkpoint(str(src), art_dir, src, overwrite=True)
    assert (src / "config.json").exists()


# ----------------------------------------------------------------------------- refusals


def test_artifact_for_another_model(tmp_path):
    src, model = save_tiny(tmp_path, "llama")
    other = tiny_model("llama", rope_theta=1234.0)         # same geometry, other config
    art_dir = tmp_path / "art"
    make_artifact(art_dir, other)
    with pytest.raises(ArtifactError, match="fingerprint"):
        fold_checkpoint(str(src), art_dir, tmp_path / "out")
    deeper = tmp_path / "art3"
    make_artifact(deeper, tiny_model("llama", layers=3))
    with pytest.raises(ArtifactError, match="num_layers is 3 but this model has 2"):
        fold_checkpoint(str(src), deeper, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_already_folded_artifact(tmp_path):
    src, model = save_tiny(tmp_path)
    art_dir = tmp_path / "art"
    make_artifact(art_dir, model, metadata={"v_folded": "true"})
    with pytest.raises(ArtifactError, match="v_folded"):
        fold_checkpoint(str(src), art_dir, tmp_path / "out")
    with pytest.raises(ArtifactError, match="v_folded"):
        fold_v_rotation(model, load_artifact(art_dir))
    assert not (tmp_path / "out").exists()


def test_invalid_artifact_is_refused_with_the_validators_line(tmp_path):
    """A NaN anywhere (here a K rotation, which folding never touches) or a non-orthogonal rotation
    is refused up front with `oscar validate`'s line; nothing is written."""
    from oscar_calib.tools.validate import validate_artifact

    src, model = save_tiny(tmp_path)
    art = build_artifact(model)
    art.layers[1].k_rotation[0, 2, 3] = float("nan")
    bad = tmp_path / "bad"
    bad.mkdir()
    write_artifact_files(bad, art, "# bad\n", {})
    line = validate_artifact(bad).problems[0]
    assert line == "layers.1.k_rotation has 1 non-finite value(s)"
    with pytest.raises(ArtifactError) as exc:
        fold_checkpoint(str(src), bad, tmp_path / "out")
    assert str(exc.value) == f"{bad}: {line}"
    assert not (tmp_path / "out").exists()
    with pytest.raises(ArtifactError, match="layers.1.k_rotation has 1 non-finite"):
        fold_v_rotation(copy.deepcopy(model), art)                 # an artifact in memory too
    skewed = build_artifact(model)
    skewed.layers[0].v_rotation[1] *= 1.01
    folded = copy.deepcopy(model)
    with pytest.raises(ArtifactError, match=r"layers.0.v_rotation is not orthogonal: .* on KV head 1"):
        fold_v_rotation(folded, skewed)
    assert torch.equal(folded.model.layers[0].self_attn.v_proj.weight, model.model.layers[0].self_attn.v_proj.weight)


def test_unsupported_layouts(monkeypatch):
    from oscar_calib.model import registry

    model = make_model("llama")
    art = build_artifact(model)
    fp8 = copy.deepcopy(model)
    v = fp8.model.layers[1].self_attn.v_proj
    v.weight = torch.nn.Parameter(v.weight.to(torch.float8_e4m3fn), requires_grad=False)
    before = fp8.model.layers[0].self_attn.v_proj.weight.clone()
    with pytest.raises(UnsupportedModelError, match="not a plain float tensor"):
        fold_v_rotation(fp8, art)
    assert torch.equal(fp8.model.layers[0].self_attn.v_proj.weight, before)    # nothing changed, not even layer 0
    scaled = copy.deepcopy(model)
    scaled.model.layers[0].self_attn.o_proj.register_buffer("weight_scale_inv", torch.ones(1))
    with pytest.raises(UnsupportedModelError, match="weight_scale_inv"):
        fold_v_rotation(scaled, art)
    monkeypatch.setitem(registry.ARCHITECTURES, "llama", registry.ArchSpec(v_proj=None))
    with pytest.raises(UnsupportedModelError, match="no value/output projection"):
        fold_v_rotation(copy.deepcopy(model), art)


def test_quantised_model_refused_gguf_marker_dropped(tmp_path):
    from types import SimpleNamespace

    model = make_model("llama")
    art_dir = tmp_path / "art"
    make_artifact(art_dir, model)
    model.hf_quantizer = SimpleNamespace(quantization_config=SimpleNamespace(quant_method="awq"))
    with pytest.raises(UnsupportedModelError, match=r"quantised \(awq\)"):
        fold_checkpoint("tiny", art_dir, tmp_path / "out", loaded=wrap(model))
    assert not (tmp_path / "out").exists()
    # a GGUF-loaded model carries a quantiser over de-quantised float weights: it folds, and the
    # checkpoint is plain safetensors; without a tokenizer the proof runs on random ids
    gguf = make_model("llama")
    gguf.hf_quantizer = SimpleNamespace(quantization_config=SimpleNamespace(quant_method="gguf"))
    gguf.config.quantization_config = {"quant_method": "gguf"}
    res = fold_checkpoint("tiny", art_dir, tmp_path / "out", loaded=wrap(gguf))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["oscar"]["v_folded"] is True
    assert res.report["check"]["input"] == "random" and not (tmp_path / "out" / "tokenizer_config.json").exists()


# ----------------------------------------------------------------------------- CLI


def test_cli_json_and_one_line_error(tmp_path):
    src, model = save_tiny(tmp_path, "qwen3")
    art_dir = tmp_path / "art"
    make_artifact(art_dir, model)
    out = tmp_path / "out"
    res = oscar("fold-weights", str(src), str(art_dir), "--out", str(out), "--device", "cpu", "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["check"]["logits_rel_diff"] <= CHECK_TOLERANCE and report["reload"]["ok"]
    assert (out / "config.json").exists()

    wrong = tmp_path / "wrong"
    make_artifact(wrong, tiny_model("qwen3", rope_theta=99.0))
    target = tmp_path / "out2"
    code, _, err = oscar("fold-weights", str(src), str(wrong), "--out", str(target))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert_one_line_error(code, err, "fingerprint")
    assert not target.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["art", "out", "src-qwen3", "wrong"]


# ----------------------------------------------------------------------------- the real SmolLM2


SMOL_SAMPLE = (1, 32)     # CPU time: the proof's default is 2x64


@pytest.fixture(scope="module")
def folded_smollm2(tmp_path_factory, smollm2, demo_artifact):
    model, tok, src = smollm2
    out = tmp_path_factory.mktemp("fold") / "smollm2-oscar"
    folded = copy.deepcopy(model)              # the fixture model is shared: fold a copy
    res = fold_checkpoint("smollm2-135m", demo_artifact, out, loaded=LoadedModel.wrap(folded, tok, src), sample_shape=SMOL_SAMPLE)
    return folded, out, res


def test_smollm2_fold_exact(smollm2, demo_artifact, folded_smollm2):
    model, tok, _ = smollm2
    folded, _, res = folded_smollm2
    art = load_artifact(demo_artifact)
    ids, kind = sample_input_ids(tok, model.config.vocab_size, SMOL_SAMPLE)
    assert kind == "embedded"
    figures = assert_fold_exact(model, folded, [layer.v_rotation for layer in art.layers], ids, art.group_size)
    c = res.report["check"]
    assert c["logits_rel_diff"] <= CHECK_TOLERANCE and c["value_rel_err"] <= CHECK_TOLERANCE
    assert len(c["value_rel_err_per_layer"]) == 30 and c["tokens"] == list(SMOL_SAMPLE)
    print("smollm2 fold figures:", figures)


def test_smollm2_checkpoint_reloads(smollm2, demo_artifact, folded_smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok, _ = smollm2
    _, out, res = folded_smollm2
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    tok2 = AutoTokenizer.from_pretrained(out)
    ids, _ = sample_input_ids(tok2, model.config.vocab_size, SMOL_SAMPLE)
    assert torch.equal(ids, sample_input_ids(tok, model.config.vocab_size, SMOL_SAMPLE)[0])   # tokenizer saved
    d = rel_diff(logits(model, ids), logits(reloaded, ids))
    assert d <= CHECK_TOLERANCE, d
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["oscar"]["v_folded"] is True
    sha = hashlib.sha256((demo_artifact / WEIGHTS_NAME).read_bytes()).hexdigest()
    assert cfg["oscar"]["artifact_fingerprint"] == sha
    assert read_metadata(out / "oscar")["v_folded"] == "true"
    print(f"smollm2 reload rel diff {d:.3g}; timings {res.report['timings']}")
