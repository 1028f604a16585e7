"""The transformers range and the per-layer attention types, in both shapes transformers returns."""

from __future__ import annotations

import pytest
import transformers
from factories import tiny_model

from oscar_calib.errors import UnsupportedModelError
from oscar_calib.runtime.compat import (
    SUPPORTED_TRANSFORMERS,
    cache_slots,
    check_transformers,
    layer_windows,
)
from oscar_calib.versions import version_tuple


def test_installed_version_is_in_the_tested_range():
    check_transformers()                                    # the suite runs at 5.23 and, in make test-low, 5.17
    for ok in ("5.17.0", "5.23.0", "5.20.1.dev0"):
        check_transformers(ok)
    for bad in ("4.57.1", "5.16.2", "5.24.0", "6.0.0"):
        with pytest.raises(UnsupportedModelError, match="5.17"):
            check_transformers(bad)
    assert SUPPORTED_TRANSFORMERS == (">=5.17", "<5.24")


def test_pyproject_declares_the_same_range():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert f'"transformers{",".join(SUPPORTED_TRANSFORMERS)}"' in text


@pytest.mark.parametrize("kind, want", [("llama", [(None, None)] * 2), ("gemma3", [(8, None), (None, None)]),
                                        ("mistral", [(8, None)] * 2)])
def test_layer_windows(kind, want):
    assert layer_windows(tiny_model(kind).config) == want


def test_layer_windows_reads_the_517_dict_form(monkeypatch):
    """transformers 5.17 returns one kwargs dict for all layers (5.23: a list per layer)."""
    import transformers.cache_utils as cu

    monkeypatch.setattr(cu, "get_layer_types_and_kwargs",
                        lambda cfg: (["sliding_attention", "full_attention"], {"sliding_window": 512}))
    assert layer_windows(tiny_model("gemma3").config) == [(512, None), (None, None)]
    monkeypatch.setattr(cu, "get_layer_types_and_kwargs", lambda cfg: (["chunked_attention"] * 2, {"sliding_window": 4}))
    assert layer_windows(tiny_model("llama").config) == [(4, 4), (4, 4)]
    # a hybrid's linear-attention layers keep their state beside the attention layers; a layer that reuses another's
    # KV cache (transformers' "dummy") is refused, and so is a model without attention layers
    monkeypatch.setattr(cu, "get_layer_types_and_kwargs",
                        lambda cfg: (["linear_attention", "full_attention"], {"number_of_states": 1}))
    assert layer_windows(tiny_model("llama").config) == [(None, None)]
    assert [s.state for s in cache_slots(tiny_model("llama").config)] == [{"number_of_states": 1}, None]
    monkeypatch.setattr(cu, "get_layer_types_and_kwargs", lambda cfg: (["dummy"] * 2, {}))
    with pytest.raises(UnsupportedModelError, match="'dummy' layer; the OSCAR caches support full"):
        layer_windows(tiny_model("llama").config)
    monkeypatch.setattr(cu, "get_layer_types_and_kwargs", lambda cfg: (["linear_attention"] * 2, {}))
    with pytest.raises(UnsupportedModelError, match="names no attention layers"):
        layer_windows(tiny_model("llama").config)
    assert version_tuple(transformers.__version__) >= (5, 17)
