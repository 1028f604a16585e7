"""oscar push / pull against patched hub clients: the exact calls, refusals, credentials, pull cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from factories import assert_one_line_error, bad_clips, make_artifact, oscar

import oscar_calib.tools.publish as publish
from oscar_calib.contract.artifact import WEIGHTS_NAME, read_metadata
from oscar_calib.errors import ArtifactError, InputError, OutputExistsError

FILES = ["README.md", "calibration.json", "oscar.safetensors", "verify.json"]


class Recorder:
    """A fake client class: every instance logs (method, args, kwargs) into the class's calls."""

    calls: list
    fail: Exception | None = None

    def __init__(self, *args, **kwargs):
        type(self).calls.append(("__init__", args, kwargs))

    def __getattr__(self, name):
        def method(*args, **kwargs):
            type(self).calls.append((name, args, kwargs))
            if type(self).fail is not None and name == "upload_folder":
                raise type(self).fail
        return method


def fake_client():
    return type("FakeClient", (Recorder,), {"calls": []})


@pytest.fixture
def artifact(tmp_path) -> Path:
    art = make_artifact(tmp_path / "art")
    digest = read_metadata(art)["content_sha256"]                  # verify.json verified this content
    (art / "verify.json").write_text(json.dumps({"passed": True, "content_sha256": digest,
                                                  "summary": {"max_rel_error": 0.01}}))
    (art / ".oscar-checkpoint.pt").write_bytes(b"x")      # hidden: never pushed
    (art / "notes.tmp").write_text("scratch")             # temporary: never pushed
    return art


@pytest.fixture
def hf(monkeypatch):
    client = fake_client()
    monkeypatch.setattr(publish, "HfApi", client)
    monkeypatch.setattr(publish, "hf_get_token", lambda: None)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    return client


@pytest.fixture
def ms(monkeypatch):
    client = fake_client()
    monkeypatch.setattr(publish, "modelscope_api_class", lambda: client)
    monkeypatch.setattr(publish, "modelscope_logged_in", lambda: False)
    monkeypatch.setenv("MODELSCOPE_API_TOKEN", "ms_secret")
    return client


# ----------------------------------------------------------------------------- push

def test_push_hf_makes_the_exact_calls(artifact, hf):
    result = oscar("push", str(artifact), "--to", "hf:my-org/tiny-oscar", "--private",
                   "--revision", "v1", "--commit-message", "first rotations")
    assert result.exit_code == 0, result.output
    assert hf.calls == [
        ("__init__", (), {"token": "hf_secret"}),
        ("create_repo", ("my-org/tiny-oscar",), {"repo_type": "model", "private": True, "exist_ok": True}),
        ("create_branch", ("my-org/tiny-oscar",), {"branch": "v1", "repo_type": "model", "exist_ok": True}),
        ("upload_folder", (), {"repo_id": "my-org/tiny-oscar", "repo_type": "model", "folder_path": str(artifact),
                               "allow_patterns": FILES, "commit_message": "first rotations", "revision": "v1"}),
    ]
    assert "https://huggingface.co/my-org/tiny-oscar/tree/v1" in result.stdout


def test_push_hf_defaults_and_stored_login(artifact, hf, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(publish, "hf_get_token", lambda: "stored_token")
    url = publish.push(publish.plan_push(artifact, "hf:org/name"))
    assert url == "https://huggingface.co/org/name"
    names = [c[0] for c in hf.calls]
    assert names == ["__init__", "create_repo", "upload_folder"]          # no branch without --revision
    assert hf.calls[0][2] == {"token": "stored_token"}
    upload = hf.calls[2][2]
    assert upload["revision"] is None and upload["commit_message"].startswith("OSCAR rotations for test/tiny")
    assert hf.calls[1][2]["private"] is False


def test_push_modelscope_makes_the_exact_calls(artifact, ms):
    plan = publish.plan_push(artifact, "modelscope:my-org/tiny-oscar", revision="v2", commit_message="m")
    assert publish.push(plan) == "https://modelscope.cn/models/my-org/tiny-oscar"
    assert ms.calls == [
        ("__init__", (), {"token": "ms_secret"}),
        ("create_repo", ("my-org/tiny-oscar",), {"token": "ms_secret", "repo_type": "model", "visibility": "public",
                                                 "exist_ok": True}),
        ("upload_folder", ("my-org/tiny-oscar", str(artifact)), {"repo_type": "model", "token": "ms_secret",
                                                                  "commit_message": "m", "allow_patterns": FILES,
                                                                  "revision": "v2"}),
    ]


def test_push_modelscope_uses_the_stored_login(artifact, ms, monkeypatch):
    monkeypatch.delenv("MODELSCOPE_API_TOKEN")
    monkeypatch.setattr(publish, "modelscope_logged_in", lambda: True)
    publish.push(publish.plan_push(artifact, "modelscope:org/name", private=True))
    assert ms.calls[0] == ("__init__", (), {})
    assert ms.calls[1][2]["visibility"] == "private" and ms.calls[1][2]["token"] is None


def test_missing_tokens_are_one_clear_line(artifact, hf, ms, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.delenv("MODELSCOPE_API_TOKEN")
    with pytest.raises(InputError, match="no Hugging Face token: set HF_TOKEN or run `hf auth login`"):
        publish.push(publish.plan_push(artifact, "hf:org/name"))
    with pytest.raises(InputError, match="no ModelScope token: set MODELSCOPE_API_TOKEN"):
        publish.push(publish.plan_push(artifact, "modelscope:org/name"))
    assert hf.calls == [] and ms.calls == []


def test_unverified_needs_force_and_invalid_is_never_pushed(tmp_path, hf):
    art = make_artifact(tmp_path / "unverified")
    with pytest.raises(ArtifactError, match="is not verified: no verify.json"):
        publish.plan_push(art, "hf:org/name")
    (art / "verify.json").write_text(json.dumps({"passed": False}))
    with pytest.raises(ArtifactError, match='does not say "passed": true'):
        publish.plan_push(art, "hf:org/name")
    plan = publish.plan_push(art, "hf:org/name", force=True)
    assert plan.verified is False
    bad = make_artifact(tmp_path / "bad", mutate=bad_clips)
    (bad / "verify.json").write_text(json.dumps({"passed": True}))
    result = oscar("push", str(bad), "--to", "hf:org/name", "--force")
    assert_one_line_error(result.exit_code, result.stderr, "outside (0, 1]")
    assert hf.calls == []


def test_no_model_card_is_refused(artifact, hf):
    (artifact / "README.md").unlink()
    with pytest.raises(ArtifactError, match="no model card"):
        publish.plan_push(artifact, "hf:org/name")


def test_dry_run_touches_no_network(artifact, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("network client used in a dry run")
    monkeypatch.setattr(publish, "HfApi", boom)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    result = oscar("push", str(artifact), "--to", "hf:org/name", "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    sizes = {f: (artifact / f).stat().st_size for f in FILES}
    assert doc["files"] == [{"name": f, "bytes": sizes[f]} for f in FILES]
    assert doc["total_bytes"] == sum(sizes.values()) and doc["url"] == "https://huggingface.co/org/name"
    assert doc["dry_run"] is True and doc["verified"] is True
    text = oscar("push", str(artifact), "--to", "hf:org/name", "--dry-run").stdout
    assert "oscar.safetensors" in text and "nothing was uploaded" in text and ".oscar-checkpoint.pt" not in text


@pytest.mark.parametrize("target", ["hf:bad", "github:org/name", "hf:org/na me", "org/name", "hf:../x",
                                    "hf:org/name/extra", "modelscope:org/", "hf:-org/name"])
def test_malformed_targets(target):
    with pytest.raises(InputError, match="malformed target"):
        publish.parse_target(target)


def test_parse_target_forms():
    assert publish.parse_target("hf:Org/Name-1.5") == publish.Target("hf", "Org/Name-1.5")
    assert publish.parse_target("ms:org/name") == publish.Target("modelscope", "org/name")


def test_main_maps_errors_to_one_line_and_exit_2(artifact):
    code, _, err = oscar("push", str(artifact), "--to", "hf:not-a-repo")
    assert code == 2
    assert err.strip().splitlines() == ["error: malformed target 'hf:not-a-repo': expected hf:ORG/NAME or modelscope:ORG/NAME "
                   "(letters, digits, '.', '_', '-')"]


def test_client_failure_is_one_line(artifact, hf):
    hf.fail = RuntimeError("403 Forbidden: no write access\nlong server body")
    with pytest.raises(publish.PublishError) as exc:
        publish.push(publish.plan_push(artifact, "hf:org/name"))
    assert str(exc.value) == "Hugging Face push to hf:org/name failed: 403 Forbidden: no write access"


# ----------------------------------------------------------------------------- pull

@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("OSCAR_CACHE", str(root))
    return root


def fake_download(source: Path, calls: list):
    def download(**kwargs):
        calls.append(kwargs)
        local = Path(kwargs["local_dir"])
        for f in source.iterdir():
            shutil.copy(f, local / f.name)
        (local / ".cache" / "huggingface").mkdir(parents=True)      # what huggingface_hub leaves behind
        return str(local)
    return download


def test_pull_hf_into_the_cache_then_refresh(tmp_path, cache, monkeypatch):
    src = make_artifact(tmp_path / "remote")
    calls = []
    monkeypatch.setattr(publish, "hf_snapshot_download", fake_download(src, calls))
    result = oscar("pull", "hf:my-org/tiny-oscar", "--revision", "v1", "--json")
    assert result.exit_code == 0, result.output
    dest = cache / "zoo" / "hf" / "my-org" / "tiny-oscar"
    assert json.loads(result.stdout)["path"] == str(dest)
    assert len(calls) == 1
    kw = calls[0]
    assert (kw["repo_id"], kw["repo_type"], kw["revision"]) == ("my-org/tiny-oscar", "model", "v1")
    assert Path(kw["local_dir"]).parent == dest.parent and Path(kw["local_dir"]) != dest
    assert (dest / WEIGHTS_NAME).read_bytes() == (src / WEIGHTS_NAME).read_bytes()
    assert not (dest / ".cache").exists()
    assert json.loads((dest / publish.PULL_RECORD).read_text())["source"] == "hf:my-org/tiny-oscar"
    # a second pull replaces the cached copy; nothing temporary is left beside it
    src2 = make_artifact(tmp_path / "remote2", seed=5)
    monkeypatch.setattr(publish, "hf_snapshot_download", fake_download(src2, calls))
    publish.pull("hf:my-org/tiny-oscar")
    assert (dest / WEIGHTS_NAME).read_bytes() == (src2 / WEIGHTS_NAME).read_bytes()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["tiny-oscar"]


def test_pull_modelscope_with_out(tmp_path, cache, monkeypatch):
    src = make_artifact(tmp_path / "remote")
    calls = []
    monkeypatch.setattr(publish, "modelscope_snapshot_download", lambda: fake_download(src, calls))
    out = tmp_path / "mine"
    result = publish.pull("modelscope:org/name", out=out)
    assert result.path == out and result.report.ok and (out / WEIGHTS_NAME).exists()
    assert calls[0]["repo_id"] == "org/name" and calls[0]["revision"] is None
    with pytest.raises(OutputExistsError, match="not empty; pass --overwrite"):
        publish.pull("modelscope:org/name", out=out)
    publish.pull("modelscope:org/name", out=out, overwrite=True)
    assert len(calls) == 2


def test_pull_refuses_an_invalid_download_and_leaves_nothing(tmp_path, cache, monkeypatch):
    src = make_artifact(tmp_path / "remote", mutate=bad_clips)
    monkeypatch.setattr(publish, "hf_snapshot_download", fake_download(src, []))
    with pytest.raises(ArtifactError, match="downloaded artifact is invalid: .*outside"):
        publish.pull("hf:org/name")
    parent = cache / "zoo" / "hf" / "org"
    assert list(parent.iterdir()) == []

    def offline(**kwargs):
        raise OSError("Network is unreachable")
    monkeypatch.setattr(publish, "hf_snapshot_download", offline)
    with pytest.raises(publish.PublishError, match="cannot download hf:org/name .*Network is unreachable"):
        publish.pull("hf:org/name")
    assert list(parent.iterdir()) == []
