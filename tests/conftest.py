"""Session fixtures, the test tiers and the Triton backend.

Tiers (markers, registered in pyproject.toml): ``slow`` (a real model, a whole calibration of
one, several processes or ranks, injected faults, a kernel run for seconds under the Triton
interpreter, a torch.compile), ``gpu`` (needs CUDA: skipped without it, by
the hook below), ``script`` (runs a script under ``scripts/``). ``make test-fast`` deselects all
three. A test that requests a real-model fixture (``smollm2`` and every fixture built on it) is
``slow`` without saying so.

The real SmolLM2 loads once per session (the first load de-quantises its GGUF, ~30 s, and caches a
float copy under $OSCAR_CACHE; later sessions load in ~2 s). Tiny random-init models and the
artifacts built from them (``factories``) cover everything else.
"""

from __future__ import annotations

import os

# Before torch loads its OpenMP runtime: idle threads sleep instead of spinning (what `oscar`
# itself sets; on a busy 2-core machine spinning threads take the cores the work needs: float64
# QRs and products ran 2.6x slower at load 16). Every process a test starts inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from factories import (  # noqa: E402
    FAST,
    ON_GPU,
    byte_tokenizer,
    calibrate_tiny,
    left_as_found,
    loaded_tiny,
    save_checkpoint,
    tiny_model,
)

if not ON_GPU:
    # Triton kernels run under the CPU interpreter. Set before any @triton.jit function is
    # created: the kernel modules are imported lazily, on first use, so this is early enough.
    os.environ["TRITON_INTERPRET"] = "1"


# Fixtures that load a real model: a test requesting one (directly or through another fixture)
# is in the slow tier.
REAL_MODEL_FIXTURES = {"smollm2"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if REAL_MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None and not ON_GPU:
        pytest.skip("needs CUDA (runs on a GPU machine)")


@pytest.fixture(autouse=True)
def _process_left_as_found(request):
    """No test changes the process for the tests after it (:func:`factories.left_as_found`: the
    ``TRITON_*`` / ``OSCAR_*`` variables and Triton's interpreter flag after every test, the whole
    environment after a test that runs a script in this process). Set up before ``monkeypatch``
    (``_no_backend_override`` asks for it first), so it checks after monkeypatch has restored what
    a test set through it."""
    with left_as_found(whole=request.node.get_closest_marker("script") is not None):
        yield


@pytest.fixture(autouse=True)
def _no_backend_override(_process_left_as_found, monkeypatch):
    """The kernel backend is each test's choice, never the caller's OSCAR_KERNELS."""
    monkeypatch.delenv("OSCAR_KERNELS", raising=False)


@pytest.fixture
def device() -> str:
    """Where kernel tests put their tensors: CUDA when present, else the CPU (interpreter)."""
    return "cuda" if ON_GPU else "cpu"

# ----------------------------------------------------------------------------- the real SmolLM2


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
    from oscar_calib.calibration.pipeline import calibrate
    from oscar_calib.contract.config import CalibrationConfig

    out = tmp_path_factory.mktemp("demo") / "smollm2"
    calibrate(CalibrationConfig(**FAST), out, loaded=smollm2_loaded)
    return out

@pytest.fixture(scope="session")
def zoo_smollm2() -> Path:
    """The committed SmolLM2 artifact, ``zoo/smollm2-135m`` (read-only): a real calibration of the
    real model without running one."""
    return Path(__file__).resolve().parents[1] / "zoo" / "smollm2-135m"

# ----------------------------------------------------------------------------- tiny models and artifacts


@pytest.fixture
def tiny():
    return tiny_model


@pytest.fixture
def char_tokenizer():
    from factories import CharTokenizer

    return CharTokenizer()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random-init Llama checkpoint (2 layers, float32 safetensors) with a byte tokenizer:
    real files the CLI loads in a second."""
    tok = byte_tokenizer()
    return save_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama", tiny_model("llama", vocab_size=len(tok)),
                           tok)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny random-init Llama checkpoint (3 layers) with a byte tokenizer: what launched ranks and
    torchrun "nodes" load from disk."""
    tok = byte_tokenizer()
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama",
                           tiny_model("llama", vocab_size=len(tok), layers=3), tok)


@pytest.fixture(scope="session")
def plain_artifact(tmp_path_factory, tiny_dir) -> Path:
    """``tiny_dir`` calibrated from its files by one process with one thread (as each rank runs),
    512 tokens of 64: what the data-parallel and big-model (device map) runs must reproduce.
    Read-only."""
    import torch

    from oscar_calib.calibration.pipeline import calibrate
    from oscar_calib.contract.config import CalibrationConfig

    out = tmp_path_factory.mktemp("plain") / "out"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        calibrate(CalibrationConfig(model=str(tiny_dir), tokens=512, seq_len=64, batch_size=2, heldout_tokens=48,
                                    device="cpu"), out)
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="session")
def tiny_bit_budget(tmp_path_factory):
    """The CalibrationResult of ``calibrate_tiny`` on a 3-layer tiny Llama with head_dim 64 under
    ``bit_budget=2.7`` (one layer gets groups of 32), once per session (read-only; the model is
    ``loaded_tiny("llama", head_dim=64, layers=3)``)."""
    return calibrate_tiny(tmp_path_factory.mktemp("bit-budget") / "b", loaded=loaded_tiny("llama", head_dim=64, layers=3),
                          bit_budget=2.7)


@pytest.fixture(scope="session")
def tiny_calibrated(tmp_path_factory) -> Path:
    """``calibrate_tiny`` of the default tiny Llama with TINY_FAST settings, once per session
    (read-only: copy it before changing anything). A rerun with the same settings is byte-identical."""
    out = tmp_path_factory.mktemp("tiny-calibrated") / "a"
    calibrate_tiny(out)
    return out

