"""Shared fixtures. The real SmolLM2 loads once per session (the first load de-quantises its
GGUF, ~30 s, and caches a float copy under $OSCAR_CACHE; later sessions load in ~2 s).
Tiny random-init models cover the other architectures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import FAST, CharTokenizer, byte_tokenizer, tiny_model  # noqa: F401  (re-exported for fixtures)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():
    # Triton kernels run under the CPU interpreter; must be set before any kernel is defined
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer, source) of the real SmolLM2-135M-Instruct, float32 on the CPU."""
    from oscar_calib.model.load import load_model

    lm = load_model("smollm2-135m", device="cpu")
    return lm.model, lm.tokenizer, lm.source


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2):
    """The same model wrapped as a LoadedModel (model.load), as every tool takes it."""
    from oscar_calib.model.load import LoadedModel

    return LoadedModel.wrap(*smollm2)


@pytest.fixture(scope="session")
def demo_artifact(tmp_path_factory, smollm2_loaded) -> Path:
    """A SmolLM2 artifact calibrated once per session with FAST settings (read-only: copy it
    before changing anything)."""
    from oscar_calib.calibrate.pipeline import calibrate
    from oscar_calib.spec.config import CalibrationConfig

    out = tmp_path_factory.mktemp("demo") / "smollm2"
    calibrate(CalibrationConfig(**FAST), out, loaded=smollm2_loaded)
    return out


@pytest.fixture
def tiny():
    return tiny_model


@pytest.fixture
def char_tokenizer():
    return CharTokenizer()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2) -> Path:
    """A tiny random-init Llama saved as a HF checkpoint with SmolLM2's tokenizer (real files the
    CLI can load in a second)."""
    _, tok, _ = smollm2
    model = tiny_model("llama", vocab_size=len(tok))
    d = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny random-init Llama checkpoint (float32 safetensors, 3 layers) with a byte tokenizer: what
    launched ranks and torchrun "nodes" load from disk."""
    tok = byte_tokenizer()
    d = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    tiny_model("llama", vocab_size=len(tok), layers=3).save_pretrained(d)
    tok.save_pretrained(d)
    return d
