"""oscar export / import: the SGLang fork's files, round trips, and refusals that leave nothing behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_validate import make_artifact, random_rotation
from typer.testing import CliRunner

import oscar_calib.model.load as models
from oscar_calib.cli import app
from oscar_calib.errors import ArtifactError, OutputExistsError
from oscar_calib.model.load import ModelSource
from oscar_calib.spec.artifact import WEIGHTS_NAME, load_artifact
from oscar_calib.tools.sglang import export_sglang, import_sglang
from oscar_calib.tools.validate import validate_artifact

runner = CliRunner()


def read_env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))


def test_export_per_head_artifact_is_format_2(demo_artifact, tmp_path):
    out = tmp_path / "serve"
    result = runner.invoke(app, ["export", str(demo_artifact), "--format", "sglang", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["clips.json", "k_rotations.pt", "serve.env", "v_rotations.pt"]
    art = load_artifact(demo_artifact)
    for which in ("k", "v"):
        payload = torch.load(out / f"{which}_rotations.pt", weights_only=True)
        assert payload["format_version"] == 2 and sorted(payload["layers"]) == list(range(30))
        for i in (0, 17, 29):
            entry = payload["layers"][i]
            assert entry["rotation"].dtype == torch.float32 and entry["rotation"].shape == (3, 64, 64)
            assert torch.equal(entry["rotation"], getattr(art.layers[i], f"{which}_rotation"))
            assert torch.equal(entry["eigenvalues"], getattr(art.layers[i], f"{which}_eigenvalues"))
    env = read_env(out / "serve.env")
    k_mean = torch.stack([layer.k_clip for layer in art.layers]).mean().item()
    assert float(env["OSCAR_K_CLIP"]) == pytest.approx(k_mean, abs=1e-4)
    assert (env["OSCAR_SINK_TOKENS"], env["OSCAR_RECENT_TOKENS"], env["OSCAR_GROUP_SIZE"]) == ("64", "256", "64")
    assert env["OSCAR_V_FOLDED"] == "0" and env["OSCAR_ROTATION_FORMAT_VERSION"] == "2"
    assert env["OSCAR_K_ROTATIONS"] == str((out / "k_rotations.pt").resolve())
    clips = json.loads((out / "clips.json").read_text())
    assert clips["v"][3] == art.layers[3].v_clip.tolist()


def test_export_per_layer_artifact_is_format_1(tmp_path):
    art = make_artifact(tmp_path / "a", granularity="layer", kv=2, d=16, metadata={"v_folded": "true"})
    out = tmp_path / "serve"
    res = export_sglang(art, out)
    assert res.format_version == 1
    loaded = load_artifact(art)
    payload = torch.load(out / "v_rotations.pt", weights_only=True)
    assert payload["format_version"] == 1 and set(payload["layers"]) == {0, 1}
    assert payload["layers"][1]["rotation"].shape == (16, 16) and payload["layers"][1]["eigenvalues"].shape == (16,)
    assert torch.equal(payload["layers"][1]["rotation"], loaded.layers[1].v_rotation[1])
    assert read_env(out / "serve.env")["OSCAR_V_FOLDED"] == "1"


def test_export_refusals_write_nothing(tmp_path):
    odd = make_artifact(tmp_path / "odd", d=12, metadata={"group_size": "4"})
    assert validate_artifact(odd).ok                      # valid, but the fork cannot serve head_dim 12
    with pytest.raises(ArtifactError, match="head_dim 12 is not a power of two"):
        export_sglang(odd, tmp_path / "out1")
    result = runner.invoke(app, ["export", str(odd), "--out", str(tmp_path / "out1")])
    assert result.exit_code != 0 and "not a power of two" in str(result.exception)
    from test_validate import _scale_rotation
    bad = make_artifact(tmp_path / "bad", mutate=_scale_rotation)
    with pytest.raises(ArtifactError, match="not orthogonal"):
        export_sglang(bad, tmp_path / "out2")
    assert not (tmp_path / "out1").exists() and not (tmp_path / "out2").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "odd"]       # no temporaries left
    result = runner.invoke(app, ["export", str(odd), "--format", "vllm", "--out", str(tmp_path / "o")])
    assert result.exit_code != 0 and "unknown --format 'vllm'" in str(result.exception)


def test_export_into_existing_directory_needs_overwrite(tmp_path):
    art = make_artifact(tmp_path / "a")
    out = tmp_path / "serve"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="pass --overwrite"):
        export_sglang(art, out)
    export_sglang(art, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["clips.json", "k_rotations.pt", "keep.txt", "serve.env",
                                                     "v_rotations.pt"]


def test_round_trip_through_the_fork_format(demo_artifact, smollm2_loaded, tmp_path):
    export_sglang(demo_artifact, tmp_path / "serve")
    res = import_sglang(tmp_path / "serve" / "k_rotations.pt", tmp_path / "serve" / "v_rotations.pt", smollm2_loaded,
                        tmp_path / "imported")
    assert validate_artifact(tmp_path / "imported").ok
    a, b = load_artifact(demo_artifact), load_artifact(tmp_path / "imported")
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.k_rotation, lb.k_rotation) and torch.equal(la.v_rotation, lb.v_rotation)
        assert torch.equal(la.v_eigenvalues, lb.v_eigenvalues)
        assert torch.equal(lb.k_clip, torch.full((3,), 0.96)) and torch.equal(lb.v_clip, torch.full((3,), 0.92))
    md = b.metadata
    assert md["model_fingerprint"] == a.metadata["model_fingerprint"] and md["model_id"] == a.metadata["model_id"]
    assert (md["composition"], md["k_objective"], md["granularity"]) == ("imported", "imported", "head")
    assert res.report["imported"]["k"]["eigenvalues"] == "file"
    assert (tmp_path / "imported" / "README.md").read_text().startswith("---\nlibrary_name: oscar")


def tiny_loaded():
    from helpers import tiny_model

    from oscar_calib.model.load import LoadedModel

    model = tiny_model("llama")          # 2 layers, 4 query / 2 KV heads, head_dim 16
    return LoadedModel.wrap(model, None, ModelSource("tiny", "test/tiny-llama", "", None, "local"))


def save(path: Path, obj) -> Path:
    torch.save(obj, path)
    return path


def test_import_version_1_without_eigenvalues(tmp_path):
    gen = torch.Generator().manual_seed(0)
    rots = random_rotation(2, 16, gen)
    k = save(tmp_path / "K.pt", {"format_version": 1, "layers": {i: {"rotation": rots[i]} for i in range(2)}})
    eig = torch.arange(16.0)                               # ascending in the file: stored descending
    v = save(tmp_path / "V.pt", {"format_version": 1, "layers": {str(i): {"rotation": rots[1 - i].double(),
                                                                        "eigenvalues": eig} for i in range(2)}})
    loaded = tiny_loaded()
    res = import_sglang(k, v, loaded, tmp_path / "out", clip=(0.9, None))
    art = load_artifact(tmp_path / "out")
    assert art.metadata["granularity"] == "layer" and art.metadata["model_fingerprint"] == loaded.fingerprint
    assert torch.equal(art.layers[0].k_rotation, rots[0].expand(2, 16, 16))
    assert torch.equal(art.layers[1].v_rotation[1], rots[0])
    assert torch.equal(art.layers[0].k_eigenvalues, torch.zeros(2, 16))
    assert torch.equal(art.layers[0].v_eigenvalues[1], eig.flip(0))
    assert art.layers[0].k_clip.tolist() == pytest.approx([0.9, 0.9])
    assert art.layers[0].v_clip[0].item() == pytest.approx(0.92)
    assert res.report["imported"]["k"]["eigenvalues"] == "zeros"
    assert json.loads((tmp_path / "out" / "calibration.json").read_text())["imported"]["v"]["eigenvalues"] == "file"


class NotATensor:
    def __init__(self):
        self.payload = 1


def _good_layers(n=2, h=2, d=16, version=2):
    gen = torch.Generator().manual_seed(1)
    r = random_rotation(h, d, gen)
    return {i: {"rotation": r if version == 2 else r[0], "eigenvalues": torch.zeros(d)} for i in range(n)}


BAD_FILES = {
    "arbitrary_object": ({"format_version": 2, "layers": {0: NotATensor()}},
                         "accepts (it pickles the Python object test_interop.NotATensor)"),
    "list": ([torch.eye(16)], "holds a list, expected a dict"),
    "nested_list": ({"format_version": 2, "layers": _good_layers(), "extra": [1, 2]}, "['extra'] holds a list"),
    "version_3": ({"format_version": 3, "layers": _good_layers()}, "unsupported format_version 3"),
    "missing_layer": ({"format_version": 2, "layers": _good_layers(n=1)},
                      "has layers 0..0 (1), the model has layers 0..1"),
    "wrong_head_dim": ({"format_version": 2, "layers": _good_layers(d=8)},
                       "layer 0 rotation has shape [2, 8, 8], expected [2, 16, 16]"),
    "v1_shape_in_v2": ({"format_version": 2, "layers": _good_layers(version=1)}, "expected [2, 16, 16]"),
    "not_orthogonal": ({"format_version": 2, "layers": {i: {"rotation": 1.01 * torch.eye(16).expand(2, 16, 16)}
                                                        for i in range(2)}}, "layer 0 rotation is not orthogonal"),
    "bad_eigenvalues": ({"format_version": 2, "layers": {i: {"rotation": torch.eye(16).expand(2, 16, 16).clone(),
                                                             "eigenvalues": torch.zeros(3)} for i in range(2)}},
                        "layer 0 eigenvalues have shape [3]"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES) + ["garbage_bytes"])
def test_import_refuses_bad_files_and_writes_nothing(tmp_path, name):
    good = save(tmp_path / "V.pt", {"format_version": 2, "layers": _good_layers()})
    bad = tmp_path / "K.pt"
    if name == "garbage_bytes":
        bad.write_bytes(b"definitely not a pickle")
        expected = "not a plain tensor dict that torch.load(weights_only=True) accepts"
    else:
        obj, expected = BAD_FILES[name]
        save(bad, obj)
    with pytest.raises(ArtifactError) as exc:
        import_sglang(bad, good, tiny_loaded(), tmp_path / "out")
    msg = str(exc.value)
    assert msg.startswith(f"{bad}: ") and expected in msg and "\n" not in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["K.pt", "V.pt"]


def test_import_cli(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "load_model", lambda spec, **kw: tiny_loaded())
    k = save(tmp_path / "K.pt", {"format_version": 2, "layers": _good_layers()})
    v = save(tmp_path / "V.pt", {"format_version": 2, "layers": _good_layers()})
    out = tmp_path / "art"
    result = runner.invoke(app, ["import", str(k), str(v), "--model", "tiny", "--out", str(out),
                                 "--clip", "k=0.5,v=0.25", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["granularity"] == "head" and doc["model_id"] == "test/tiny-llama"
    art = load_artifact(out)
    assert art.layers[1].k_clip.tolist() == [0.5, 0.5] and art.layers[1].v_clip.tolist() == [0.25, 0.25]
    before = (out / WEIGHTS_NAME).read_bytes()
    result = runner.invoke(app, ["import", str(k), str(v), "--model", "tiny", "--out", str(out)])
    assert result.exit_code != 0 and "already holds an artifact" in str(result.exception)
    assert (out / WEIGHTS_NAME).read_bytes() == before
