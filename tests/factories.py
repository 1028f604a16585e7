"""What tests share: tiny models and tokenizers, calibration settings, hand-made artifacts, the CLI
run in-process, and the kernel tests' parameter grids.

Test modules import from here (``from factories import ...``; ``tests/`` is on pytest's
``pythonpath``), never from one another. Fixtures built from these helpers live in
``conftest.py``; worker scripts that tests start as processes import this module too.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch

ON_GPU = torch.cuda.is_available()
TESTS = Path(__file__).resolve().parent        # tests/: factories and the worker processes
REPO = TESTS.parent

# ----------------------------------------------------------------------------- calibration settings

# The real SmolLM2 calibrated in about a minute on a CPU (the session's ``demo_artifact``).
FAST = dict(tokens=1024, seq_len=256, batch_size=2, heldout_tokens=128, pilot_tokens=256, checkpoint_every=1,
            device="cpu")
# A tiny model calibrated in about a second: 4 batches of 2 x 64 tokens.
TINY_FAST = dict(FAST, tokens=512, seq_len=64, heldout_tokens=48, pilot_tokens=64)
# `oscar calibrate` options of a quick run on a tiny checkpoint (no verify pass).
FAST_ARGS = ["--tokens", "256", "--seq-len", "64", "--heldout-tokens", "32", "--no-verify", "--device", "cpu"]

# ----------------------------------------------------------------------------- tiny models

TINY = {
    "llama": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2),
    "llama_mha": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=4),
    "mistral": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=8),
    "qwen2": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2),
    "gemma3": dict(model_type="gemma3_text", num_attention_heads=4, num_key_value_heads=1, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16),
    # a logit soft-cap small enough to bite on random weights (Gemma 2's own is 50)
    "gemma2": dict(model_type="gemma2", num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
                   attn_logit_softcapping=1.0),
}


def tiny_model(kind: str = "llama", *, head_dim: int = 16, layers: int = 2, seed: int = 0, **overrides):
    """A random-init causal LM of family ``kind`` (see TINY), float32, eval mode; ``overrides``
    go to its config (``vocab_size`` defaults to 128)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY[kind])
    model_type = spec.pop("model_type")
    spec.update(overrides)
    vocab = spec.pop("vocab_size", 128)
    cfg = AutoConfig.for_model(model_type, vocab_size=vocab, hidden_size=64, intermediate_size=96,
                               num_hidden_layers=layers, head_dim=head_dim, max_position_embeddings=512, **spec)
    if model_type == "qwen2":
        cfg.use_sliding_window = False
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.requires_grad_(False)
    return model


def sharpen(m):
    """``m`` with queries and keys 6x larger: sharp attention and wide INT2 steps, so what the cache
    stores moves the logits measurably (a random-init model attends almost uniformly)."""
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
    return m


def family_model(name: str):
    """The tiny random-init stand-in of family ``name`` (``oscar_calib.model.families``), the test
    skipped where the installed transformers lacks the family; a gpt-oss stand-in gets sink logits
    (1 to 3) that take a real share of every softmax (its initial ones are near 0)."""
    import pytest

    from oscar_calib.model.families import FAMILIES

    fam = FAMILIES[name]
    if not fam.available():
        pytest.skip(f"{name} needs transformers >= {fam.since}")
    model = fam.model()
    share_sinks(model)
    return model


def share_sinks(model) -> None:
    """Give every attention module that has learned sinks (gpt-oss) sink logits from 1 to 3."""
    for module in model.modules():
        sinks = getattr(module, "sinks", None)
        if isinstance(sinks, torch.nn.Parameter):
            with torch.no_grad():
                sinks.copy_(torch.linspace(1.0, 3.0, sinks.numel()))


class CharTokenizer:
    """A minimal in-memory tokenizer for tiny models: bytes mod vocab, EOS = 0 (not saveable)."""

    eos_token_id = 0
    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + (b % 120) for b in text.encode()]}


def byte_tokenizer():
    """A saveable byte-level BPE tokenizer built in code (no files, no network): 256 bytes + EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")


def ascii_tokenizer():
    """A saveable character-level tokenizer (printable ASCII, one token per character, EOS 1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{chr(c): i + 2 for i, c in enumerate(range(32, 127))}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="</s>")


def loaded_tiny(kind: str = "llama", **kw):
    """A tiny random-init model (``tiny_model(kind, **kw)``) wrapped as the LoadedModel every
    tool takes, with a CharTokenizer."""
    from oscar_calib.model.geometry import geometry_of, model_fingerprint
    from oscar_calib.model.load import LoadedModel
    from oscar_calib.model.source import ModelSource

    model = tiny_model(kind, **kw)
    src = ModelSource(spec=f"tiny-{kind}", model_id=f"tiny-{kind}", path="", kind="local")
    return LoadedModel(model, CharTokenizer(), src, geometry_of(model), model_fingerprint(model))


def save_checkpoint(directory: Path, model, tokenizer) -> Path:
    """``model`` and ``tokenizer`` saved as a Hugging Face checkpoint directory (what the CLI loads)."""
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def calibrate_tiny(out: Path, kind: str = "llama", loaded=None, *, overwrite: bool = False, **settings):
    """``calibrate()`` of a tiny model (``loaded``, else a fresh ``loaded_tiny(kind)``) with
    TINY_FAST settings updated by ``settings``; returns its CalibrationResult."""
    from oscar_calib.calibration.pipeline import calibrate
    from oscar_calib.contract.config import CalibrationConfig

    return calibrate(CalibrationConfig(**{**TINY_FAST, **settings}), out, loaded=loaded or loaded_tiny(kind),
                     overwrite=overwrite)


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()

# ----------------------------------------------------------------------------- hand-made artifacts


FAKE_FINGERPRINT = hashlib.sha256(b"not a real model").hexdigest()


def random_rotation(heads: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """Random orthogonal ``[heads, d, d]`` float32 (the kernels' test helper, seeded by ``gen``)."""
    from oscar_calib.kernels.testing import random_rotation as rotation

    return rotation(heads, d, generator=gen)


def build_artifact(model=None, *, layers: int = 2, kv: int = 2, heads: int = 4, d: int = 8,
                   granularity: str = "head", seed: int = 0, metadata: dict | None = None, centered: bool = False):
    """A format-v1 Artifact in memory: random orthogonal K and V rotations per layer and KV head
    (one per layer, shared by the heads, with ``granularity="layer"``), clips 0.95 / 0.9 and
    descending random eigenvalues.

    With ``model`` the geometry (attention layers and their decoder-layer ids, KV and query heads,
    head_dim, per layer where layers differ) and the fingerprint are the model's, so the artifact
    fits it; otherwise ``layers`` x ``kv`` x ``d`` with ``heads`` query heads and a fingerprint of
    no model. ``metadata`` overrides or adds metadata keys. ``centered``: key centering, a random
    mean key ``k_mean [kv, d]`` per layer (its own shape where layers differ; metadata ``k_centered``).
    """
    from oscar_calib import FORMAT_VERSION
    from oscar_calib.contract.artifact import Artifact, LayerRotations
    from oscar_calib.contract.defaults import default_group_size
    from oscar_calib.contract.layout import FORMAT_NAME

    fingerprint, model_type, per_layer = FAKE_FINGERPRINT, "llama", {}
    shapes = [(kv, d)] * layers
    if model is not None:
        from oscar_calib.contract.settings import ArtifactSettings
        from oscar_calib.model.geometry import geometry_of, model_fingerprint

        geo = geometry_of(model)
        layers, kv, heads, d = geo.num_layers, geo.num_kv_heads, geo.num_attention_heads, geo.head_dim
        fingerprint, model_type = model_fingerprint(model), model.config.model_type
        shapes = list(zip(geo.kv_heads, geo.head_dims))
        keys = ("layer_ids", "layer_head_dims", "layer_kv_heads")
        settings = ArtifactSettings(**geo.settings_fields(), group_size=default_group_size(min(geo.head_dims)),
                                    sink_tokens=64, recent_tokens=256).metadata()
        per_layer = {k: v for k, v in settings.items() if k in keys} | {"group_size": settings["group_size"]}
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for hk, dk in shapes:
        k, v = random_rotation(hk, dk, gen), random_rotation(hk, dk, gen)
        if granularity == "layer":
            k, v = k[:1].expand(hk, dk, dk).clone(), v[:1].expand(hk, dk, dk).clone()
        eig = torch.rand(hk, dk, generator=gen).sort(dim=-1, descending=True).values
        rows.append(LayerRotations(k, v, torch.full((hk,), 0.95), torch.full((hk,), 0.9), eig, eig.clone(),
                                   k_mean=torch.randn(hk, dk, generator=gen) if centered else None))
    md = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "model_id": "test/tiny",
          "model_fingerprint": fingerprint, "num_layers": str(layers), "num_attention_heads": str(heads),
          "num_kv_heads": str(kv), "head_dim": str(d), "group_size": str(default_group_size(d)), "bits": "2",
          "sink_tokens": "64", "recent_tokens": "256", "k_objective": "qqt", "v_objective": "sst",
          "composition": "u_h_pbr", "granularity": granularity,
          "calibration": json.dumps({"data": "test", "tokens": 0}), "toolkit_version": "0.1.0",
          "model_type": model_type, **per_layer,
          **({"k_centered": "true"} if centered else {})}
    md.update(metadata or {})
    return Artifact(layers=rows, metadata=md)


def make_artifact(out: Path, model=None, *, mutate: Callable[[dict], None] | None = None,
                  metadata: dict | None = None, **build) -> Path:
    """``build_artifact(model, **build)`` written to the directory ``out`` (card, report and
    tensors, as calibrate writes them); ``mutate(tensors)`` may damage the tensors and ``metadata``
    override metadata keys afterwards, in the file's bytes (an artifact in memory refuses invalid
    settings, so a damaged file is written past it: see ``bad_clips``, ``skewed_rotation``).
    Returns ``out``."""
    from oscar_calib.contract.artifact import (
        WEIGHTS_NAME,
        serialize_artifact,
        write_artifact_files,
    )

    art = build_artifact(model, **build)
    layers = art.num_layers
    out.mkdir(parents=True, exist_ok=True)
    report = {"summary": {"mean_attn_error_oscar": 0.5, "mean_attn_error_hadamard": 0.7,
                          "layers_better_than_hadamard": layers, "num_layers": layers}}
    write_artifact_files(out, art, "# test artifact\n", report)
    if mutate is not None or metadata:
        tensors = art.tensors()
        if mutate is not None:
            mutate(tensors)
        (out / WEIGHTS_NAME).write_bytes(serialize_artifact(tensors, {**art.metadata, **(metadata or {})}))
    return out


def bad_clips(tensors: dict) -> None:
    """Two clip ratios outside (0, 1] (layer 1's V clip of head 0, layer 0's K clip of head 1)."""
    tensors["layers.1.v_clip"][0] = 1.5
    tensors["layers.0.k_clip"][1] = 0.0


def nan_k_rotation(tensors: dict) -> None:
    """One NaN in layer 1's K rotation (head 0)."""
    tensors["layers.1.k_rotation"][0, 2, 3] = float("nan")


def skewed_rotation(tensors: dict) -> None:
    """Layer 1's K rotation of head 1 scaled by 1.001: no longer orthogonal."""
    tensors["layers.1.k_rotation"][1] *= 1.001

# ----------------------------------------------------------------------------- the CLI in-process


class CliResult(NamedTuple):
    """What ``oscar ARGS`` did: exit code, standard output, standard error."""

    exit_code: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def oscar(*args, env: dict[str, str | None] | None = None) -> CliResult:
    """``oscar ARGS`` run in this process through the console script's entry point
    (``oscar_calib.cli.main``: the typed-error mapping to one ``error: ...`` line and its exit
    code, warnings as one line each), with stdin, stdout, stderr and ``env`` isolated by Typer's
    CliRunner. An exception the CLI does not map propagates, as a bug should."""
    from typer.testing import CliRunner

    from oscar_calib.cli import main

    runner = CliRunner()
    with runner.isolation(env=env) as (out, err, _):
        argv, sys.argv = sys.argv, ["oscar", *map(str, args)]
        code = 0
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            sys.argv = argv
            sys.stdout.flush()
            sys.stderr.flush()
        stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    return CliResult(code, stdout, stderr)


def assert_one_line_error(code: int, err: str, pattern: str) -> None:
    """A failed command whose last stderr line is ``error: ...`` containing ``pattern``, no traceback."""
    assert code != 0
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: ") and pattern in lines[-1], err
    assert "Traceback" not in err

# ----------------------------------------------------------------------------- scripts in-process


# Set by the tools on first use, not by a test: pytest names the running test and phase in
# PYTEST_CURRENT_TEST; torch's CUDA initialisation sets CUDA_MODULE_LOADING=LAZY where the caller
# left it unset (torch/cuda/__init__.py, _lazy_init); torch.compile, the first time it compiles,
# sets TORCHINDUCTOR_CACHE_DIR to its cache folder (torch/_inductor/runtime/cache_dir_utils.py,
# cache_dir) and TRITON_PTXAS_PATH to the ptxas torch ships (compile_tasks.py,
# _set_triton_ptxas_path; torch 2.11 and 2.13, seen on an H200), TRITON_LIBDEVICE_PATH where CUDA_HOME
# holds a libdevice (the same file) and, at the first Triton kernel it builds for a GPU,
# TRITON_CACHE_DIR where the caller left it unset (triton_heuristics.py, CachingAutotuner.__init__);
# oscar_calib.model.load turns the hub's progress bars off (HF_HUB_DISABLE_PROGRESS_BARS) at the
# first model it loads.
SET_BY_LIBRARIES = frozenset({"PYTEST_CURRENT_TEST", "CUDA_MODULE_LOADING", "TORCHINDUCTOR_CACHE_DIR",
                              "TRITON_PTXAS_PATH", "TRITON_LIBDEVICE_PATH", "TRITON_CACHE_DIR",
                              "HF_HUB_DISABLE_PROGRESS_BARS",
                              # importing FlashInfer 0.7.4 sets CUTE_DSL_CACHE_DIR (probed on an H200); the
                              # two KMP_* were seen changed there after a CPU-model test with FlashInfer on
                              # the path, by a library not pinned down (no test sets them)
                              "CUTE_DSL_CACHE_DIR", "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK"})


def triton_interpret_flag():
    """Triton's interpreter switch as Triton reads it now, or None where triton is not imported."""
    knobs = getattr(sys.modules.get("triton"), "knobs", None)
    return getattr(getattr(knobs, "runtime", None), "interpret", None)


def process_state() -> dict:
    """What a test may change for the tests after it besides the environment: the working
    directory, and once torch is imported its threads, default dtype, grad mode and determinism."""
    state = {"working directory": os.getcwd()}
    torch = sys.modules.get("torch")
    if torch is not None:
        state.update({"torch threads": torch.get_num_threads(), "torch default dtype": torch.get_default_dtype(),
                      "torch grad mode": torch.is_grad_enabled(),
                      "torch deterministic algorithms": torch.are_deterministic_algorithms_enabled()})
    return state


@contextmanager
def left_as_found(*, whole: bool):
    """Fail (AssertionError) if the block leaves the process changed for the code after it.
    Triton decides at import whether its kernels run under the CPU interpreter, from
    ``TRITON_INTERPRET``: a test that leaves it (or Triton's flag) changed turns every later
    kernel test into an interpreter run. Checked: the ``TRITON_*`` and ``OSCAR_*`` variables and
    Triton's flag; with ``whole``, every environment variable (but :data:`SET_BY_LIBRARIES`); and
    :func:`process_state` (torch's part once torch is imported)."""
    before, flag, state = dict(os.environ), triton_interpret_flag(), process_state()
    yield
    after = dict(os.environ)
    keys = (set(before) | set(after)) - SET_BY_LIBRARIES
    keys = keys if whole else {k for k in keys if k.startswith(("TRITON_", "OSCAR_"))}
    changed = sorted(k for k in keys if before.get(k) != after.get(k))
    assert not changed, f"environment variables left changed for the code after this: {changed}"
    assert flag is None or triton_interpret_flag() == flag, "Triton's interpreter flag left changed"
    now = process_state()
    moved = {k: (v, now[k]) for k, v in state.items() if k in now and now[k] != v}
    assert not moved, f"left changed for the code after this (before, after): {moved}"


def quick_without_interpreter(main, out: Path, argv: list[str]) -> str:
    """A benchmark's ``main(["--quick", "--out", out, *argv])`` called in this process with no
    ``TRITON_INTERPRET`` (the caller removes it): the one-line error it exits with, checked to leave
    the environment as it was and to write nothing. main() never sets the variable itself (Triton
    would then load every later kernel under its interpreter); run as a program, the script does."""
    with left_as_found(whole=True):
        msg = script_error(main, ["--quick", "--out", str(out), *argv])
    assert "TRITON_INTERPRET" not in os.environ and not out.exists()
    assert msg.startswith("error: ") and "\n" not in msg
    return msg


def load_script(relpath: str):
    """The script ``scripts/<relpath>`` imported as a module (once per session), with its folder on
    ``sys.path`` as when it runs, so its ``main(argv)`` can be called in the test's process."""
    path = REPO / "scripts" / relpath
    mod = sys.modules.get(path.stem)
    if mod is not None and Path(getattr(mod, "__file__", "")).resolve() == path:
        return mod
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod


def script_error(main, argv) -> str:
    """The one-line error a script's ``main(argv)`` exits with (Python prints it on stderr, status 1)."""
    import pytest

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert isinstance(e.value.code, str), e.value.code
    return e.value.code

# ----------------------------------------------------------------------------- kernel test grids


def grid(full: Iterable, interpreted: Sequence) -> list:
    """A kernel test's parameters: the ``full`` grid where the kernels compile for a GPU, the
    subset ``interpreted`` (one case per regime; each must be in ``full``) under the Triton CPU
    interpreter, which runs a kernel program by program in Python (seconds per case)."""
    full = list(full)
    missing = [p for p in interpreted if p not in full]
    assert not missing, f"interpreted cases outside the full grid: {missing}"
    return full if ON_GPU else list(interpreted)
