"""oscar pull rotationzoo:MODEL against a local mock of the upstream repository (no network): finding the
K/V pair by listing the repo, choosing the tag, the fingerprint from configs/ geometry or a model's
config.json, what the card records, the zoo listing, and one-line errors."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from factories import assert_one_line_error, oscar

from oscar_calib.errors import InputError, PublishError
from oscar_calib.tools import rotationzoo
from oscar_calib.tools.export.ptfile import payload, save_bytes

TAG_8B = "seq20000_prompt83_group128"


@functools.cache
def rotations(n: int, d: int, seed: int) -> list[torch.Tensor]:
    """``n`` random orthogonal ``[d, d]`` matrices (cached: compare, never change them)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0].float() for _ in range(n)]


class FakeHub:
    """A repository: path -> (num_layers, head_dim, seed) of a fork-format rotation file."""

    def __init__(self, layout: dict[str, tuple[int, int, int]], fail: bool = False):
        self.layout, self.fail, self.downloads, self.listed = layout, fail, [], []

    def list_repo_files(self, repo_id, revision):
        if self.fail:
            raise ConnectionError("Max retries exceeded with url: /api/models/x")
        self.listed.append((repo_id, revision))
        return ["README.md", ".gitattributes", *self.layout]

    def download_file(self, repo_id, filename, revision, local_dir):
        n, d, seed = self.layout[filename]
        path = Path(local_dir) / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        eig = [torch.linspace(1, 0, d) for _ in range(n)]
        path.write_bytes(save_bytes(payload(rotations(n, d, seed), eig, objective=Path(filename).stem[11:])))
        self.downloads.append((repo_id, filename, revision))
        return path


def layout_8b() -> dict:
    out = {}
    for i, task in enumerate(("GPQA/seq20000_prompt83_group128", "LongBench/seq150000_prompt44_group128")):
        out[f"qwen3-8B/{task}/rotations/k_rotation_qqt_r_h_pbr.pt"] = (36, 128, 10 * i)
        out[f"qwen3-8B/{task}/rotations/v_rotation_sst_r_h_pbr.pt"] = (36, 128, 10 * i + 1)
        out[f"qwen3-8B/{task}/rotations/k_rotation_hadamard.pt"] = (36, 128, 10 * i + 2)
    out["Qwen3-32B/GPQA/seq16000_prompt69_group128/rotations/k_rotation_qqt_r_h_pbr.pt"] = (64, 128, 7)
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("OSCAR_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def use(monkeypatch, hub: FakeHub) -> FakeHub:
    monkeypatch.setattr(rotationzoo, "list_repo_files", hub.list_repo_files)
    monkeypatch.setattr(rotationzoo, "download_file", hub.download_file)
    return hub


def test_pull_qwen3_8b_from_the_mock_layout(monkeypatch, cache):
    from oscar_calib.contract.artifact import load_artifact
    from oscar_calib.model.configs import configs_dir, load_model_config
    from oscar_calib.model.geometry import config_fingerprint
    from oscar_calib.tools.validate import validate_artifact
    from oscar_calib.tools.zoo import list_entries

    hub = use(monkeypatch, FakeHub(layout_8b()))
    pulled = rotationzoo.pull_rotationzoo("rotationzoo:Qwen/Qwen3-8B")        # the model id works too
    out = cache / "zoo" / "rotationzoo" / "qwen3-8b"
    assert pulled.out == out and validate_artifact(out).ok
    directory = f"qwen3-8B/GPQA/{TAG_8B}/rotations"                           # the config's pinned tag
    assert hub.listed == [("Zhongzhu/OSCAR-RotationZoo", None)]
    assert [f for _, f, _ in hub.downloads] == [f"{directory}/k_rotation_qqt_r_h_pbr.pt",
                                               f"{directory}/v_rotation_sst_r_h_pbr.pt"]
    art = load_artifact(out)
    md = art.metadata
    geo = load_model_config(configs_dir() / "qwen3-8b.yaml").geometry
    assert md["model_id"] == "Qwen/Qwen3-8B" and md["model_fingerprint"] == config_fingerprint(geo.to_hf_config())
    assert (md["group_size"], md["sink_tokens"], md["recent_tokens"], md["granularity"]) == ("128", "64", "256", "layer")
    assert art.shared_clips() == (0.96, 0.92)
    want = rotations(36, 128, 0)
    assert torch.equal(art.layers[5].k_rotation[3], want[5]) and art.num_kv_heads == 8
    report = json.loads((out / "calibration.json").read_text())
    src = report["imported"]["source"]
    assert src["calibration_tag"] == TAG_8B and (src["tag_tokens"], src["tag_prompts"], src["tag_group_size"]) == \
        (20000, 83, 128)
    assert src["repository"] == "hf:Zhongzhu/OSCAR-RotationZoo" and src["directory"] == directory
    card = (out / "README.md").read_text()
    assert f"| calibration_tag | {TAG_8B} |" in card and f"| directory | {directory} |" in card
    assert "fingerprint from configs/qwen3-8b.yaml geometry, not the model's own config" in card
    assert "| clips | k=0.96, v=0.92 (configs/qwen3-8b.yaml: the fork's scripts) |" in card
    (entry,) = list_entries(cache / "empty-zoo")
    assert (entry.source, entry.remote, entry.model_id) == ("rotationzoo", "rotationzoo:qwen3-8b", "Qwen/Qwen3-8B")
    # the other calibration by --tag: a tag or any part of the path (a pull with --tag and --out,
    # end to end: test_choosing_the_tag_and_clear_errors, on a tiny model)
    pairs = rotationzoo.model_pairs(rotationzoo.rotation_pairs(list(layout_8b())), ["qwen3-8b"])
    other = rotationzoo.choose_pair(pairs, tag="LongBench", pinned=TAG_8B, what="Qwen/Qwen3-8B")
    assert other.tag == "seq150000_prompt44_group128"
    assert other.files() == (f"qwen3-8B/LongBench/{other.tag}/rotations/k_rotation_qqt_r_h_pbr.pt",
                             f"qwen3-8B/LongBench/{other.tag}/rotations/v_rotation_sst_r_h_pbr.pt")


def tiny_config(directory: Path, *, tag: str | None = None, **zoo) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    section = {"names": ["tiny-llama"], "k_clip": 0.95, "v_clip": 0.9, "group_size": 16, "sink": 8, "recent": 16,
               **({"tag": tag} if tag else {}), **zoo}
    doc = {"geometry": {"model_id": "tests/tiny-llama", "model_type": "llama", "num_layers": 2,
                        "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 16, "hidden_size": 64,
                        "intermediate_size": 96, "vocab_size": 49152, "max_position_embeddings": 512},
           "calibration": {"model": "tests/tiny-llama"}, "rotationzoo": section}
    import yaml

    (directory / "tiny-llama.yaml").write_text(yaml.safe_dump(doc))
    return directory


def tiny_layout(*tags: str) -> dict:
    out = {}
    for i, tag in enumerate(tags):
        out[f"Tiny_Llama/{tag}/k_rotation_qqt_r_h_pbr.pt"] = (2, 16, 2 * i)
        out[f"Tiny_Llama/{tag}/v_rotation_sst_r_h_pbr.pt"] = (2, 16, 2 * i + 1)
    return out


def test_choosing_the_tag_and_clear_errors(monkeypatch, cache, tmp_path):
    import oscar_calib.model.configs as configs

    monkeypatch.setattr(configs, "configs_dir", lambda: tiny_config(tmp_path / "configs"))
    use(monkeypatch, FakeHub(tiny_layout("seq100_prompt1_group16", "seq200_prompt2_group16")))
    with pytest.raises(InputError) as exc:                   # two calibrations, no pinned tag: list them
        rotationzoo.pull_rotationzoo("rotationzoo:tiny-llama")
    assert str(exc.value) == ("2 rotation directories for tests/tiny-llama (Tiny_Llama/seq100_prompt1_group16; "
                              "Tiny_Llama/seq200_prompt2_group16); choose one with --tag")
    pulled = rotationzoo.pull_rotationzoo("rotationzoo:tiny-llama", tag="seq200_prompt2_group16")
    assert pulled.source["tag_tokens"] == 200 and pulled.result.artifact.metadata["fork_k_clip"] == "0.95"
    with pytest.raises(InputError, match="--tag 'seq9_prompt9_group16' matches 0 of the rotation directories"):
        rotationzoo.pull_rotationzoo("rotationzoo:tiny-llama", tag="seq9_prompt9_group16")
    with pytest.raises(InputError, match="no RotationZoo recipe for 'nope'; known: tiny-llama"):
        rotationzoo.pull_rotationzoo("rotationzoo:nope")
    use(monkeypatch, FakeHub({"other-model/x/k_rotation_a.pt": (2, 16, 0), "other-model/x/v_rotation_a.pt": (2, 16, 1)}))
    with pytest.raises(InputError) as exc:
        rotationzoo.pull_rotationzoo("rotationzoo:tiny-llama")
    assert str(exc.value) == ("hf:Zhongzhu/OSCAR-RotationZoo has no K/V rotation files under a directory named "
                              "tiny-llama; it holds 1 rotation directories: other-model/x")
    use(monkeypatch, FakeHub({}, fail=True))
    with pytest.raises(PublishError, match=r"^cannot list hf:Zhongzhu/OSCAR-RotationZoo \(no network"):
        rotationzoo.pull_rotationzoo("rotationzoo:tiny-llama")
    # a group size in the tag that does not fit the model: one line, nothing written
    use(monkeypatch, FakeHub(tiny_layout("seq100_prompt1_group32")))
    with pytest.raises(InputError, match="group size 32 is not a power of two dividing head_dim 16"):
        rotationzoo.pull_rotationzoo("rotationzoo:tiny-llama", out=tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_model_option_takes_the_fingerprint_of_its_config(monkeypatch, cache, tmp_path, tiny_llama_dir):
    """--model: the fingerprint of the model's config.json (meta device, no weights) is the one loading
    the checkpoint gives, so the artifact validates against the real model."""
    import oscar_calib.model.configs as configs
    from oscar_calib.model.load import load_model
    from oscar_calib.tools.validate import model_reference, validate_artifact

    monkeypatch.setattr(configs, "configs_dir", lambda: tiny_config(tmp_path / "configs", tag="seq1_prompt1_group16"))
    use(monkeypatch, FakeHub(tiny_layout("seq1_prompt1_group16")))
    pulled = rotationzoo.pull_rotationzoo("rotationzoo:tiny-llama", model=str(tiny_llama_dir), out=tmp_path / "a")
    lm = load_model(str(tiny_llama_dir))
    assert pulled.result.artifact.metadata["model_fingerprint"] == lm.fingerprint
    assert validate_artifact(tmp_path / "a", model=model_reference(str(tiny_llama_dir))).ok
    assert f"fingerprint from the config.json of {tiny_llama_dir}" in (tmp_path / "a" / "README.md").read_text()
    # the CLI: --json, and the rotationzoo options refused for hub artifacts
    r = oscar("pull", "rotationzoo:tiny-llama", "--out", str(tmp_path / "b"), "--clip", "k=1,v=0.8",
              "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["source"] == "rotationzoo:tiny-llama" and doc["calibration_tag"] == "seq1_prompt1_group16"
    assert doc["clips"].startswith("k=1, v=0.8")
    r = oscar("pull", "hf:org/name", "--tag", "x")
    assert_one_line_error(r.exit_code, r.stderr, "rotationzoo:MODEL sources only")


def test_upstream_seed_models_in_the_zoo_index(tmp_path):
    from oscar_calib.tools.zoo import build_index, upstream_table

    index = build_index(tmp_path)
    ups = {u["name"]: u for u in index["upstream"]}
    assert set(ups) == {"qwen3-4b-thinking-2507", "qwen3-8b", "qwen3-32b", "glm-4.7-fp8"}
    assert (ups["qwen3-32b"]["k_clip"], ups["qwen3-32b"]["v_clip"]) == (0.96, 0.96)
    assert (ups["qwen3-8b"]["v_clip"], ups["qwen3-8b"]["tag"]) == (0.92, TAG_8B)
    assert ups["glm-4.7-fp8"]["pull"] == "oscar pull rotationzoo:glm-4.7-fp8"
    table = upstream_table(index)
    assert ("| `Qwen/Qwen3-8B` | 36 × 8 × 128 | `seq20000_prompt83_group128` | 0.96 / 0.92 | 128, 64 + 256 | "
            "`oscar pull rotationzoo:qwen3-8b` |") in table
