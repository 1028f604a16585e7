"""Test helpers shared by many test files (imported as ``helpers``; fixtures live in conftest.py).

Kept out of conftest.py on purpose: two conftest modules (tests/ and tests/kernels/) would
shadow each other under ``from conftest import ...``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

# Small, fast calibration settings used by end-to-end tests.
FAST = dict(tokens=1024, seq_len=256, batch_size=2, heldout_tokens=128, pilot_tokens=256, checkpoint_every=1,
            device="cpu")


TINY = {
    "llama": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2),
    "llama_mha": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=4),
    "mistral": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=8),
    "qwen2": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2),
    "gemma3": dict(model_type="gemma3_text", num_attention_heads=4, num_key_value_heads=1, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16),
}


def tiny_model(kind: str = "llama", *, head_dim: int = 16, layers: int = 2, seed: int = 0, **overrides):
    """A random-init causal LM of family ``kind`` (see TINY), float32, eval mode."""
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


class CharTokenizer:
    """A minimal tokenizer for tiny models: bytes mod vocab, EOS = 0."""

    eos_token_id = 0
    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + (b % 120) for b in text.encode()]}


def loaded_tiny(kind: str = "llama", **kw):
    """A tiny random-init model wrapped as a LoadedModel (model.load; character tokenizer)."""
    from oscar_calib.model.geometry import geometry_of, model_fingerprint
    from oscar_calib.model.load import LoadedModel, ModelSource

    model = tiny_model(kind, **kw)
    src = ModelSource(spec=f"tiny-{kind}", model_id=f"tiny-{kind}", path="", kind="local")
    return LoadedModel(model, CharTokenizer(), src, geometry_of(model), model_fingerprint(model))


def byte_tokenizer():
    """A byte-level tokenizer built in code (no files, no network): 256 bytes + EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")


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


def run_main(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """``oscar ARGS`` in this process through the console entry point (so library errors become
    their one line and exit code): ``(exit code, stdout, stderr)``."""
    import sys

    from oscar_calib.cli import main

    monkeypatch.setattr(sys, "argv", ["oscar", *args])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def small_artifact(out, *, layers: int = 2, kv: int = 2, heads: int = 4, d: int = 8, seed: int = 0,
                   metadata: dict | None = None):
    """A small hand-made format-v1 artifact in ``out`` (random orthogonal rotations, fitted-looking
    clips and descending eigenvalues), written the toolkit's way: with its content digest, a card
    and a report. Returns ``out``."""
    import hashlib
    import json

    from oscar_calib.spec.artifact import Artifact, LayerRotations, write_artifact_files

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(layers):
        q, r = torch.linalg.qr(torch.randn(2, kv, d, d, generator=gen, dtype=torch.float64))
        rot = (q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)).float()
        eig = torch.rand(kv, d, generator=gen).sort(dim=-1, descending=True).values
        rows.append(LayerRotations(rot[0], rot[1], torch.full((kv,), 0.95), torch.full((kv,), 0.9), eig, eig.clone()))
    md = {"format": "oscar-rotations", "format_version": "1", "model_id": "test/tiny",
          "model_fingerprint": hashlib.sha256(b"not a real model").hexdigest(), "num_layers": str(layers),
          "num_attention_heads": str(heads), "num_kv_heads": str(kv), "head_dim": str(d),
          "group_size": str(min(d, 128)), "bits": "2", "sink_tokens": "64", "recent_tokens": "256",
          "k_objective": "qqt", "v_objective": "sst", "composition": "u_h_pbr", "granularity": "head",
          "calibration": json.dumps({"data": "test", "tokens": 0}), "toolkit_version": "0.1.0", "model_type": "llama",
          **(metadata or {})}
    out.mkdir(parents=True, exist_ok=True)
    write_artifact_files(out, Artifact(layers=rows, metadata=md), "# test artifact\n", {})
    return out
