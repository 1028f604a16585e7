"""Where the held-out fits run: the clips and held-out errors are computed where the held-out rows
are (a GPU when the model runs on one), with the rotations and covariances moved to them. The
CUDA test runs on the GPU machine (``tests/calibrate`` there); on a CPU it is skipped, and the
plumbing tests below run instead."""

from __future__ import annotations

import pytest
import torch

from oscar_calib.calibration.collect import StatsRun, fit_device
from oscar_calib.calibration.fit import heldout_layer
from oscar_calib.calibration.stats import Reservoir
from oscar_calib.errors import InputError
from oscar_calib.numerics.clip import (
    HeldoutLayer,
    fit_k_clip,
    fit_v_clip,
    heldout_errors,
)
from oscar_calib.numerics.hadamard import hadamard


def held_layer(t=96, hq=4, hkv=2, d=32, seqs=2, seed=0) -> HeldoutLayer:
    g = torch.Generator().manual_seed(seed)
    rows = lambda h: [torch.randn(t, h, d, generator=g) * (1 + torch.arange(d) / 8) for _ in range(seqs)]  # noqa: E731
    return HeldoutLayer(rows(hq), rows(hkv), rows(hkv), rows(hq), d ** -0.5)


def rotations(h=2, d=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(h, d, d, generator=g, dtype=torch.float64))
    return q, torch.randn(h, d, d, generator=g, dtype=torch.float64)


def fits(held: HeldoutLayer, rot, cq, group_size=16):
    k_clip, k_table = fit_k_clip(held.k_rows(), rot, cq @ cq.transpose(1, 2), group_size)
    v_clip, v_table = fit_v_clip(held, rot, group_size)
    errors = heldout_errors(held, rot, k_clip, rot, v_clip, group_size)
    return k_clip, k_table, v_clip, v_table, errors


def test_to_the_same_device_is_the_same_object_and_another_copies_the_rows():
    held = held_layer()
    assert held.to("cpu") is held and held.device == torch.device("cpu")
    moved = held.to(torch.device("meta"))
    assert moved is not held and moved.device.type == "meta"
    assert [x.shape for x in moved.q] == [x.shape for x in held.q] and moved.scaling == held.scaling


def test_heldout_layer_goes_to_the_runs_fitting_device():
    held = held_layer()
    res = Reservoir(96)
    res.q, res.k, res.v, res.o = held.q, held.k, held.v, held.o
    run = StatsRun(stats=[], reservoir=[res], layer_info={0: {"scaling": 0.25, "sliding_window": None,
                                                               "softcap": None}})
    assert run.fit_device == "cpu" and heldout_layer(run, 0).device.type == "cpu"
    run.fit_device = "meta"
    assert heldout_layer(run, 0).device.type == "meta"


def test_fit_device_follows_the_model_unless_told(monkeypatch):
    monkeypatch.delenv("OSCAR_FIT_DEVICE", raising=False)
    assert fit_device(torch.device("cuda:1")) == "cuda:1" and fit_device(torch.device("cpu")) == "cpu"
    monkeypatch.setenv("OSCAR_FIT_DEVICE", "cpu")
    assert fit_device(torch.device("cuda:1")) == "cpu"
    monkeypatch.setenv("OSCAR_FIT_DEVICE", "gpu0")
    with pytest.raises(InputError, match="OSCAR_FIT_DEVICE='gpu0' is not a device"):
        fit_device(torch.device("cpu"))


def test_fits_take_rotations_and_covariances_from_the_cpu():
    """The fitting functions accept CPU rotations for rows anywhere and return CPU tables: the
    same numbers as before, with ``hadamard`` rotations as a second input."""
    held = held_layer()
    rot, cq = rotations()
    k_clip, k_table, v_clip, v_table, errors = fits(held, rot, cq)
    assert k_table.device.type == v_table.device.type == "cpu"
    assert k_table.shape == v_table.shape == (2, k_table.shape[1]) and torch.isfinite(k_table).all()
    h = hadamard(32, dtype=torch.float64).expand(2, -1, -1)
    _, _, _, _, errors_h = fits(held, h, cq)
    assert errors != errors_h and all(v > 0 for v in errors.values())


@pytest.mark.gpu
def test_fits_on_a_gpu_equal_the_cpu_fits():
    held = held_layer(t=160, hq=8, hkv=2, d=64)
    rot, cq = rotations(d=64)
    cpu = fits(held, rot, cq)
    gpu = fits(held.to("cuda"), rot, cq)
    # the fake quantisation runs in float32, whose rounding differs between the devices (~1e-7)
    for a, b in zip(cpu[:4], gpu[:4]):
        assert b.device.type == "cpu"
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(gpu[0], cpu[0], rtol=0, atol=0)      # the same clips chosen
    torch.testing.assert_close(gpu[2], cpu[2], rtol=0, atol=0)
    for key, v in cpu[4].items():
        assert gpu[4][key] == pytest.approx(v, rel=1e-5), key
