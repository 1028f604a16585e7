"""Every model family end to end on a tiny random-init stand-in built from its real config class
(``oscar_calib.model.families``): calibrate → validate → verify → eval → ``oscar_calib.runtime.generate``
equal to the simulation → export to each target → fold-weights, each step either working or
refused in one line exactly where the support table (``oscar_calib.tools.support``) says so. The
README's and the scaling guide's big-model commands run on a saved tiny Qwen3-MoE. gpt-oss's
attention sinks: verify and eval read them as the model does.

The cache part runs again at the low end of the transformers range: tests/runtime/test_runtime_families.py."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import pytest
import torch
from factories import (
    FAST_ARGS,
    REPO,
    CharTokenizer,
    ascii_tokenizer,
    calibrate_tiny,
    family_model,
    oscar,
    save_checkpoint,
    share_sinks,
)

from oscar_calib.errors import OscarError, UnsupportedModelError
from oscar_calib.eval import EvalOptions, run_eval
from oscar_calib.eval.verify import verify_artifact
from oscar_calib.model.families import FAMILIES
from oscar_calib.model.geometry import geometry_of
from oscar_calib.model.load import LoadedModel
from oscar_calib.model.source import ModelSource
from oscar_calib.runtime import OscarCache, SimulatedCache, generate
from oscar_calib.tools.export import TARGETS, ExportSettings
from oscar_calib.tools.fold import fold_and_check
from oscar_calib.tools.support import family_support
from oscar_calib.tools.validate import ModelReference, validate_artifact

# the families added beside the ten registered before (those have their own tests: test_fold.py,
# tests/runtime, the zoo): mixtures of experts, newer dense families, multimodal wrappers
NEW_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "llama4_text", "granitemoe", "olmo3", "seed_oss",
                "smollm3", "granite", "exaone4", "ernie4_5", "gemma3", "llama4", "mistral3", "qwen2_5_vl", "qwen3_vl",
                "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe", "falcon_h1", "lfm2",
                "gemma4_text", "gemma4", "gemma4_unified")
# a calibration in well under a second: 2 batches of 64 tokens; 8 + 8 BF16 window tokens so the
# 24-token prompt and the 48-token depths reach the INT2 history
CHAIN = dict(tokens=128, seq_len=64, heldout_tokens=32, pilot_tokens=32, sink_tokens=8, recent_tokens=8)
# llama.cpp needs the model's GGUF (--gguf): its column is checked by the support table's own test
EXPORTS = [t for t in TARGETS if t != "llamacpp"]


def _loaded(name: str) -> LoadedModel:
    """The stand-in as ``load_model`` gives it, the checkpoint's config beside it (a Llama 4
    checkpoint loads as the text model alone, ``Llama4ForCausalLM``)."""
    fam = FAMILIES[name]
    return LoadedModel.wrap(fam.model(), CharTokenizer(), ModelSource(f"tiny-{name}", f"tiny-{name}", "", kind="local"),
                            fam.config())


@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_family_end_to_end(name, tmp_path):
    if not FAMILIES[name].available():
        pytest.skip(f"{name} needs transformers >= {FAMILIES[name].since}")
    fam, lm = FAMILIES[name], _loaded(name)
    model, geo = lm.model, lm.geometry
    support = family_support(fam)
    out = tmp_path / "artifact"
    art = calibrate_tiny(out, loaded=lm, **CHAIN).artifact

    # the artifact names the text model and, for a wrapper, the config it came from
    assert art.metadata["model_type"] == geo.model_type == model.config.get_text_config(decoder=True).model_type
    assert art.metadata.get("text_config") == geo.text_config
    assert (geo.text_config or "").startswith(f"{name}.") == fam.wrapper

    report = validate_artifact(out, model=ModelReference.from_model(model))
    assert report.ok, report.problems

    v = verify_artifact(out, loaded=lm, backend="torch", depths=(32, 48), sequences=1, positions=2, write=False,
                        plot=False)
    assert [r["layer"] for r in v.layers] == list(range(geo.num_layers))
    assert all(math.isfinite(r[m]["attn"]) and r[m]["samples"] > 0 for r in v.layers for m in ("artifact", "hadamard"))

    opts = EvalOptions(methods=("bf16", "oscar"), sequences=1, seq_len=48, sink=8, recent=8)
    rows = {r["method"]: r for r in run_eval(name, out, opts, loaded=lm).rows}
    assert math.isfinite(rows["oscar"]["ppl"]) and rows["oscar"]["ppl"] != rows["bf16"]["ppl"]

    ids = torch.randint(1, 120, (1, 24), generator=torch.Generator().manual_seed(1))
    if support["cache"].ok:
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
        real = generate(model, ids, OscarCache.from_artifact(art, model, window_dtype=None), **kw)
        sim = model.generate(ids, past_key_values=SimulatedCache.from_artifact(art, model, window_dtype=None), **kw)
        assert torch.equal(real.sequences, sim.sequences)
        assert max(float((a - b).abs().max()) for a, b in zip(real.scores, sim.scores)) < 1e-4
    else:
        with pytest.raises(UnsupportedModelError) as e:
            OscarCache.from_artifact(art, model)
        assert str(e.value) == support["cache"].note

    for target in EXPORTS:
        try:
            TARGETS[target].export(out, tmp_path / target, ExportSettings())
        except OscarError as e:
            assert not support[target].ok, f"{target}: {e}"
            assert "\n" not in str(e) and support[target].note.split(", and ")[-1] in str(e)
        else:
            assert support[target].ok, f"{target} wrote files the table says it refuses: {support[target].note}"

    if support["fold-weights"].ok:
        check, _ = fold_and_check(model, art, torch.randint(1, 120, (2, 16), generator=torch.Generator().manual_seed(2)))
        assert check.ok and check.logits_rel_diff < 1e-4
    else:
        with pytest.raises(UnsupportedModelError) as e:
            fold_and_check(model, art, ids)
        assert str(e.value) == support["fold-weights"].note


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_capture_gives_the_models_own_logits(name):
    """Capture routes every attention call through an observer and returns the model's own
    output: the logits are bit for bit those without it, on every family (gpt-oss with sinks that
    take a real share, and configured for a kernel the route replaces: it falls back to eager, the
    implementation that adds them, not SDPA)."""
    from oscar_calib.model.capture import Capture

    model = family_model(name)
    ids = torch.randint(1, 120, (2, 24), generator=torch.Generator().manual_seed(8))
    seen = []
    with torch.no_grad():
        ref = model(input_ids=ids).logits                   # gpt-oss: its eager attention
        if name == "gpt_oss":
            model.config._attn_implementation = "flex_attention"
        with Capture(model, [lambda layer, *_: seen.append(layer)]):
            got = model(input_ids=ids).logits
    assert torch.equal(got, ref)
    # every attention layer, numbered as the artifact's layers (a hybrid's attention layers only)
    assert sorted(set(seen)) == list(range(geometry_of(model).num_layers))


def test_gpt_oss_sinks_reach_verify_and_eval(tmp_path):
    """With windows that hold every token (nothing INT2), verify's kernel output is the model's own
    attention, sinks included, and eval's simulation gives the model's own perplexity; without the
    sinks both would be off by the sinks' share of each softmax."""
    lm = _loaded("gpt_oss")
    share_sinks(lm.model)
    out = tmp_path / "artifact"
    calibrate_tiny(out, loaded=lm, **dict(CHAIN, sink_tokens=64, recent_tokens=64))
    v = verify_artifact(out, loaded=lm, backend="torch", depths=(32, 48), sequences=1, positions=2, write=False,
                        plot=False)
    assert max(r["artifact"]["attn"] for r in v.layers) < 1e-2                 # BF16 windows, no INT2 token
    opts = EvalOptions(methods=("bf16", "oscar"), sequences=1, seq_len=48, sink=64, recent=64)
    rows = {r["method"]: r for r in run_eval("gpt_oss", out, opts, loaded=lm).rows}
    assert abs(rows["oscar"]["ppl"] / rows["bf16"]["ppl"] - 1) < 1e-3


@pytest.mark.parametrize("name", ["qwen2_5_vl", "llama4"])
def test_a_saved_multimodal_checkpoint_calibrates_from_the_command_line(name, tmp_path):
    """A multimodal checkpoint saved by transformers loads through its own auto class (Qwen2.5-VL:
    image-text-to-text; Llama 4: transformers loads its language model alone as a causal LM) and
    the artifact names the text config it came from."""
    from transformers import AutoModelForImageTextToText

    from oscar_calib.contract.artifact import load_artifact

    torch.manual_seed(0)
    whole = AutoModelForImageTextToText.from_config(FAMILIES[name].config())     # vision tower included
    directory = save_checkpoint(tmp_path / name, whole, ascii_tokenizer())
    code, _, err = oscar("calibrate", directory, *FAST_ARGS, "--out", tmp_path / "run")
    assert code == 0, err
    md = load_artifact(tmp_path / "run").metadata
    assert md["text_config"] == f"{name}.text_config"
    assert md["model_type"] == FAMILIES[name].config().get_text_config(decoder=True).model_type


def _readme_command(prefix: str) -> list[str]:
    line = next(ln for ln in (REPO / "README.md").read_text().splitlines() if ln.startswith(prefix))
    return shlex.split(line.split("#")[0])


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory) -> Path:
    """A tiny random-init Qwen3-235B-A22B stand-in saved by transformers (configs/qwen3-235b-a22b.yaml
    at tiny width: 2 layers, 4 experts, the real 64 query / 4 KV heads of 128), as a user would
    save one to try the documented commands."""
    from oscar_calib.model.configs import configs_dir, load_model_config

    geometry = load_model_config(configs_dir() / "qwen3-235b-a22b.yaml").geometry
    return save_checkpoint(tmp_path_factory.mktemp("moe") / "tiny-qwen3-moe", geometry.tiny_model(), ascii_tokenizer())


def test_readme_big_model_command_runs_on_a_tiny_stand_in(tiny_qwen3_moe, tmp_path):
    """The README's ``oscar calibrate Qwen/Qwen3-235B-A22B --device-map auto --max-memory ...`` on the
    stand-in, the model swapped for its directory; on a machine without GPUs ``--max-memory`` keeps
    its CPU entry (GPU entries are refused there in one line) and ``--device cpu`` is added."""
    argv = _readme_command("oscar calibrate Qwen/Qwen3-235B-A22B")
    assert argv[:3] == ["oscar", "calibrate", "Qwen/Qwen3-235B-A22B"] and "--device-map" in argv
    argv[2] = str(tiny_qwen3_moe)
    if not torch.cuda.is_available():
        at = argv.index("--max-memory") + 1
        argv[at] = ",".join(p for p in argv[at].split(",") if p.startswith("cpu="))
    code, _, err = oscar(*argv[1:], *FAST_ARGS, "--out", tmp_path / "run")
    assert code == 0, err
    assert (tmp_path / "run" / "oscar.safetensors").is_file()


@pytest.mark.slow
def test_scaling_guide_ranks_each_spread_over_devices(tiny_qwen3_moe, tmp_path):
    """docs/guides/scaling.md's ``oscar calibrate Qwen/Qwen3-235B-A22B --nproc 2 --device-map auto``
    on the stand-in: two data-parallel ranks, each loading the model through a device map."""
    doc = (REPO / "docs" / "guides" / "scaling.md").read_text().splitlines()
    argv = shlex.split(next(ln for ln in doc if ln.startswith("oscar calibrate Qwen/Qwen3-235B-A22B")))
    assert "--nproc" in argv and "--device-map" in argv
    argv[2] = str(tiny_qwen3_moe)
    argv[argv.index("--out") + 1] = str(tmp_path / "run")
    code, _, err = oscar(*argv[1:], *FAST_ARGS)
    assert code == 0, err
    assert (tmp_path / "run" / "oscar.safetensors").is_file()


@pytest.mark.parametrize("recipe, layer_ids, head_dims", [
    ("qwen3.5-35b-a3b", "3", None),
    pytest.param("gemma-4-31b", None, "256,512", marks=pytest.mark.slow)])     # 32 query heads of 256 and 512
def test_the_hybrid_and_gemma4_recipes_calibrate_a_saved_stand_in(recipe, layer_ids, head_dims, tmp_path):
    """configs/qwen3.5-35b-a3b.yaml and configs/gemma-4-31b.yaml at tiny width (their real heads and
    head_dims; Qwen3.5's 3:1 pattern over 4 layers, Gemma 4's sliding and global layer), saved by
    transformers and calibrated from the command line with the recipe's settings: the artifact maps
    Qwen3.5's one attention layer to decoder layer 3, and holds Gemma 4's 256- and 512-wide layers."""
    from oscar_calib.contract.artifact import load_artifact
    from oscar_calib.model.configs import configs_dir, load_model_config

    path = configs_dir() / f"{recipe}.yaml"
    directory = save_checkpoint(tmp_path / recipe, load_model_config(path).geometry.tiny_model(), ascii_tokenizer())
    code, _, err = oscar("calibrate", directory, "--config", path, *FAST_ARGS, "--out", tmp_path / "run")
    assert code == 0, err
    md = load_artifact(tmp_path / "run").metadata
    assert md.get("layer_ids") == layer_ids and md.get("layer_head_dims") == head_dims
