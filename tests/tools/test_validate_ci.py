"""Validation in the user's CI: the pre-commit hook's entry and the GitHub Action's validate step
run (offline) on the committed zoo and on broken copies of it, `--format github` annotations and
their escaping, hub repositories validated in place against a patched snapshot download (no
network: the download functions of tools/publish.py are monkeypatched, as in tests/tools/test_publish.py)."""

from __future__ import annotations

import fnmatch
import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from factories import (
    assert_one_line_error,
    bad_clips,
    make_artifact,
    oscar,
    skewed_rotation,
)
from safetensors.torch import load_file

import oscar_calib.tools.publish as publish
from oscar_calib.contract.artifact import (
    WEIGHTS_NAME,
    read_metadata,
    serialize_artifact,
)
from oscar_calib.errors import InputError
from oscar_calib.tools.validate_ci import (
    escape_data,
    escape_property,
    expand_changed_files,
    github_lines,
    is_hub_source,
    validate_hub,
    validate_sources,
    workflow_command,
)
from oscar_calib.tools.zoo import write_index

REPO = Path(__file__).resolve().parents[2]
ANNOTATION = re.compile(r"^::error (?P<props>[^:]*)::(?P<message>.*)$")


# ----------------------------------------------------------------------------- escaping

def _unescape_data(s: str) -> str:            # what the runner does on reading a command
    return s.replace("%0D", "\r").replace("%0A", "\n").replace("%25", "%")


def _unescape_property(s: str) -> str:
    return _unescape_data(s.replace("%3A", ":").replace("%2C", ","))


def parse_annotation(line: str) -> tuple[dict[str, str], str]:
    m = ANNOTATION.match(line)
    assert m, line
    props = dict(kv.split("=", 1) for kv in m["props"].split(","))
    return {k: _unescape_property(v) for k, v in props.items()}, _unescape_data(m["message"])


def test_escaping_follows_the_runner_rules():
    assert escape_data("50% of 2\r\nbits: a, b") == "50%25 of 2%0D%0Abits: a, b"
    assert escape_property("50% of 2\r\nbits: a, b") == "50%25 of 2%0D%0Abits%3A a%2C b"
    assert escape_data("%0A") == "%250A"                      # '%' first: no double meaning
    assert workflow_command("error", "bad: 1,2", file="z/a,b:c.safetensors", title="t: x") == \
        "::error file=z/a%2Cb%3Ac.safetensors,title=t%3A x::bad: 1,2"
    assert workflow_command("error", "m", file=None, title="t") == "::error title=t::m"
    assert workflow_command("warning", "m") == "::warning::m"
    rng = random.Random(0)
    for _ in range(200):
        s = "".join(rng.choice("ab%:,\r\n=") for _ in range(rng.randint(0, 12)))
        line = workflow_command("error", s, file=s, title=s)
        assert "\n" not in line and "\r" not in line
        props, message = parse_annotation(line)
        assert props == {"file": s, "title": s} and message == s


# ----------------------------------------------------------------------------- --format github

def test_format_github_names_file_and_check(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_artifact(tmp_path / "zoo" / "good")
    make_artifact(tmp_path / "zoo" / "bad", mutate=lambda t: (bad_clips(t), skewed_rotation(t)))
    result = oscar("validate", "zoo", "--format", "github")
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    errors = [parse_annotation(ln) for ln in lines if ln.startswith("::")]
    assert {p["file"] for p, _ in errors} == {"zoo/bad/oscar.safetensors"}
    assert sorted(p["title"] for p, _ in errors) == ["oscar validate: clips", "oscar validate: clips",
                                                     "oscar validate: orthogonal"]
    assert any(m.startswith("layers.1.k_rotation is not orthogonal") for _, m in errors)
    assert "ok zoo/good (test/tiny, 2 layers)" in lines
    assert lines[-1] == "oscar validate: 2 checked, 1 with problems"
    # absolute paths inside the working directory become repository-relative
    assert github_lines(validate_sources([str(tmp_path / "zoo" / "bad")]), cwd=tmp_path)[0].startswith(
        "::error file=zoo/bad/oscar.safetensors,")
    # --json stays an alias of --format json; the two must not disagree
    doc = json.loads(oscar("validate", "zoo/good", "--json").stdout)
    assert doc["ok"] is True
    assert json.loads(oscar("validate", "zoo/good", "--format", "json").stdout) == doc
    result = oscar("validate", "zoo/good", "--json", "--format", "github")
    assert_one_line_error(result.exit_code, result.stderr, "--format")


# ----------------------------------------------------------------------------- zoos: good and broken

@pytest.fixture(scope="module")
def zoos(tmp_path_factory) -> dict[str, Path]:
    """Copies of the committed zoo (each in its own repository-like folder): as committed; with
    a truncated smollm2 file; with one non-orthogonal gemma rotation; with both."""
    out = {}
    for name in ("good", "corrupt", "rotation", "broken"):
        root = tmp_path_factory.mktemp(name)
        shutil.copytree(REPO / "zoo", root / "zoo")
        docs = root / "docs"
        docs.mkdir()
        (docs / "index.json").write_text('{"pages": []}')    # matches the hook's pattern, not a zoo index
        out[name] = root
    for name in ("corrupt", "broken"):
        f = out[name] / "zoo" / "smollm2-135m" / WEIGHTS_NAME
        f.write_bytes(f.read_bytes()[:-4096])
    for name in ("rotation", "broken"):
        f = out[name] / "zoo" / "gemma3-270m" / WEIGHTS_NAME
        tensors, md = load_file(str(f)), read_metadata(f)
        tensors["layers.3.k_rotation"][0] *= 1.01
        f.write_bytes(serialize_artifact(tensors, md))
    return out


def _env(tmp_path: Path) -> dict[str, str]:
    """`oscar` on PATH runs this checkout with this interpreter (what `pip install` gives CI)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "oscar"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m oscar_calib "$@"\n')
    shim.chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(REPO),
                HF_HUB_OFFLINE="1", COLUMNS="200")


def test_the_hook_manifest():
    hooks = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())
    hook = next(h for h in hooks if h["id"] == "oscar-validate")
    assert hook["language"] == "python" and hook["pass_filenames"] is True
    assert hook["entry"].split()[:2] == ["oscar", "validate"]
    pattern = re.compile(hook["files"])
    assert all(pattern.search(p) for p in ("oscar.safetensors", "zoo/a/oscar.safetensors", "zoo/index.json"))
    assert not any(pattern.search(p) for p in ("oscar.safetensors.bak", "my-oscar.safetensors", "zoo/README.md",
                                               "zoo/index.json5"))
    # the project's own CI (make test, which .ci/run calls) runs the same hook on zoo/
    assert "scripts/dev/run_hook.py oscar-validate zoo" in (REPO / "Makefile").read_text()


PINNED = re.compile(r"(?:rev: |uses: OWNER/oscar@)(\S+)")


def test_the_documented_pins_agree_and_resolve():
    """The hook's and the workflow's documents pin one full commit SHA (oscar makes no releases: a
    tag would not resolve). In a git checkout that commit is in this history, and its pyproject
    requires triton on Linux only, so the pinned hook installs on macOS and Windows."""
    files = (".pre-commit-hooks.yaml", "docs/examples/validate-zoo.yml", "action.yml")
    texts = {f: (REPO / f).read_text() for f in files}
    assert not any("v0.1.0" in t for t in texts.values())
    pins = {f: set(PINNED.findall(texts[f])) for f in files[:2]}
    assert all(pins.values()) and len(set().union(*pins.values())) == 1, pins
    sha = pins[files[0]].pop()
    assert re.fullmatch(r"[0-9a-f]{40}", sha), sha
    git = ["git", "-C", str(REPO)]
    if shutil.which("git") is None or subprocess.run(git + ["rev-parse", "--git-dir"], capture_output=True).returncode:
        pytest.skip("not a git checkout: the pinned commit cannot be looked up")
    assert subprocess.run(git + ["merge-base", "--is-ancestor", sha, "HEAD"]).returncode == 0, \
        f"the pinned commit {sha} is not in this repository's history: pin a commit of it"
    pyproject = subprocess.run(git + ["show", f"{sha}:pyproject.toml"], capture_output=True, text=True,
                               check=True).stdout
    from packaging.requirements import Requirement

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: the same parser as a package
        import tomli as tomllib
    triton = next(r for r in map(Requirement, tomllib.loads(pyproject)["project"]["dependencies"])
                  if r.name == "triton")
    assert triton.marker.evaluate({"platform_system": "Linux"})
    assert not triton.marker.evaluate({"platform_system": "Darwin"})


def run_hook(root: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "dev" / "run_hook.py"), "oscar-validate"], cwd=root,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=300)


@pytest.mark.script
def test_hook_passes_the_committed_zoo(zoos, tmp_path):
    proc = run_hook(zoos["good"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "oscar validate: 4 file(s)" in proc.stdout           # 2 artifacts, zoo/index.json, docs/index.json
    assert proc.stderr == ""


@pytest.mark.script
@pytest.mark.parametrize("damage,expected", [
    ("corrupt", ["zoo/smollm2-135m: truncated file: tensor data needs"]),
    ("rotation", ["zoo/gemma3-270m: layers.3.k_rotation is not orthogonal"]),
])
def test_hook_fails_a_broken_zoo(zoos, tmp_path, damage, expected):
    proc = run_hook(zoos[damage], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert "Traceback" not in proc.stderr
    stale = "zoo/index.json: stale: it does not describe the artifacts beside it; run `oscar zoo index --zoo zoo`"
    assert len(lines) == 2 and lines[0].startswith(expected[0]) and lines[1] == stale


def action_step(step_id: str) -> dict:
    action = yaml.safe_load((REPO / "action.yml").read_text())
    return next(s for s in action["runs"]["steps"] if s.get("id") == step_id), action


def run_action(root: Path, tmp_path: Path, **inputs: str) -> subprocess.CompletedProcess:
    """The action's validate step, as the runner runs it: its env with ${{ inputs.X }} filled in
    (defaults from action.yml), `bash --noprofile --norc -eo pipefail` in the workspace."""
    step, action = action_step("validate")
    values = {k: v.get("default", "") for k, v in action["inputs"].items()} | inputs
    env = _env(tmp_path)
    for k, v in step["env"].items():
        env[k] = re.sub(r"\$\{\{\s*inputs\.([\w-]+)\s*\}\}", lambda m: values[m[1]], v)
    return subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]], cwd=root,
                          env=env, capture_output=True, text=True, timeout=300)


def test_action_installs_cpu_torch_first_and_caches_pip():
    _, action = action_step("validate")
    steps = action["runs"]["steps"]
    install = next(s["run"] for s in steps if "pip install" in s.get("run", ""))
    assert install.index("install torch --index-url") < install.index('install "$GITHUB_ACTION_PATH"')
    assert action["inputs"]["torch-index-url"]["default"] == "https://download.pytorch.org/whl/cpu"
    cache = next(s for s in steps if str(s.get("uses", "")).startswith("actions/cache@"))
    assert cache["with"]["path"] == "${{ steps.pip-cache.outputs.dir }}"
    assert action["runs"]["using"] == "composite"


def test_action_passes_the_committed_zoo(zoos, tmp_path):
    proc = run_action(zoos["good"], tmp_path)                      # paths: zoo (the default)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "::" not in proc.stdout
    assert proc.stdout.splitlines() == ["ok zoo/gemma3-270m (google/gemma-3-270m, 18 layers)",
                                        "ok zoo/smollm2-135m (HuggingFaceTB/SmolLM2-135M-Instruct, 30 layers)",
                                        "ok zoo/index.json",          # a zoo directory: its index too
                                        "oscar validate: 3 checked, 0 with problems"]


def test_action_annotates_a_broken_zoo(zoos, tmp_path):
    proc = run_action(zoos["broken"], tmp_path, paths="zoo/*  missing")    # a glob and a missing path
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = [parse_annotation(ln) for ln in proc.stdout.splitlines() if ln.startswith("::")]
    assert [(p["file"], p["title"]) for p, _ in errors] == [
        ("zoo/gemma3-270m/oscar.safetensors", "oscar validate: orthogonal"),
        ("zoo/smollm2-135m/oscar.safetensors", "oscar validate: file"),
        ("missing", "oscar validate: file")]
    assert errors[0][1].startswith("layers.3.k_rotation is not orthogonal: ‖RRᵀ − I‖∞ = ")
    assert errors[1][1].startswith("truncated file") and errors[2][1] == "no such file or directory"
    # an empty paths input is one annotation, not a usage dump
    proc = run_action(zoos["good"], tmp_path, paths=" ")
    assert proc.returncode == 2 and proc.stdout.strip() == "::error title=oscar validate::the paths input is empty"


@pytest.mark.slow
def test_action_model_input_checks_the_fingerprint(zoos, tmp_path):
    proc = run_action(zoos["good"], tmp_path, paths="zoo/smollm2-135m zoo/gemma3-270m", model="smollm2-135m")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "ok zoo/smollm2-135m (HuggingFaceTB/SmolLM2-135M-Instruct, 30 layers)"
    errors = [parse_annotation(ln) for ln in lines if ln.startswith("::")]
    assert errors and {(p["file"], p["title"]) for p, _ in errors} == {
        ("zoo/gemma3-270m/oscar.safetensors", "oscar validate: model")}
    assert any("fingerprint" in m for _, m in errors)


# ----------------------------------------------------------------------------- --changed-files

def test_changed_files_zoo_index_stands_for_its_zoo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_artifact(tmp_path / "zoo" / "a")
    make_artifact(tmp_path / "zoo" / "b", seed=1)
    write_index(tmp_path / "zoo")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "index.json").write_text("[1, 2]")
    changed = ["zoo/index.json", "zoo/a/oscar.safetensors", "site/index.json", "README.md"]
    assert expand_changed_files(changed) == ([Path("zoo"), Path("zoo/a/oscar.safetensors")], [Path("zoo/index.json")])
    reports = validate_sources(changed, changed_files=True)
    assert [(str(r.path), r.ok) for r in reports] == [("zoo/a", True), ("zoo/b", True), ("zoo/index.json", True)]
    # an artifact changed without `oscar zoo index`: its index is stale
    make_artifact(tmp_path / "zoo" / "b", seed=2)
    reports = validate_sources(["zoo/index.json"], changed_files=True)
    assert [r.checks for r in reports][-1] == {"index": False, "zoo": True}
    # without --changed-files a zoo index is skipped and a non-zoo file is a problem (unchanged)
    assert [r.ok for r in validate_sources(["zoo/index.json", "site/index.json"])] == [False]


# ----------------------------------------------------------------------------- hub repositories

def fake_snapshot(source: Path, calls: list):
    """A stand-in for huggingface_hub/modelscope snapshot_download: copies ``source``'s files
    (those matching allow_patterns) into local_dir, with the client's own bookkeeping folder."""
    def download(**kwargs):
        calls.append(kwargs)
        local = Path(kwargs["local_dir"])
        for f in sorted(source.rglob("*")):
            rel = f.relative_to(source).as_posix()
            if f.is_file() and any(fnmatch.fnmatch(rel, p) for p in kwargs.get("allow_patterns") or ["*"]):
                (local / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(f, local / rel)
        (local / ".cache" / "huggingface").mkdir(parents=True)
        return str(local)
    return download


def test_hub_repository_validated_in_place_nothing_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("OSCAR_CACHE", str(tmp_path / "cache"))
    remote = tmp_path / "remote"                                   # a zoo kept on the hub
    make_artifact(remote / "smol")
    make_artifact(remote / "qwen" / "layer", granularity="layer", seed=3)
    calls = []
    monkeypatch.setattr(publish, "hf_snapshot_download", fake_snapshot(remote, calls))
    reports = validate_hub("hf:my-org/tiny-zoo@v1")
    assert [(str(r.path), r.ok) for r in reports] == [("hf:my-org/tiny-zoo@v1/qwen/layer", True),
                                                      ("hf:my-org/tiny-zoo@v1/smol", True)]
    kw = calls[0]
    assert (kw["repo_id"], kw["repo_type"], kw["revision"]) == ("my-org/tiny-zoo", "model", "v1")
    assert kw["allow_patterns"] == [f"*{WEIGHTS_NAME}"]
    assert not Path(kw["local_dir"]).exists()                      # the temporary folder is gone
    assert not (tmp_path / "cache").exists()                       # and the pull cache untouched
    # one artifact at the repository's root, through the CLI
    monkeypatch.setattr(publish, "hf_snapshot_download", fake_snapshot(make_artifact(tmp_path / "one"), calls))
    result = oscar("validate", "huggingface:my-org/tiny-oscar", "--format", "github")
    assert result.exit_code == 0 and calls[1]["revision"] is None
    assert result.stdout.splitlines()[0] == "ok hf:my-org/tiny-oscar (test/tiny, 2 layers)"


def test_modelscope_bad_artifact_and_failures(tmp_path, monkeypatch):
    bad = make_artifact(tmp_path / "bad", mutate=bad_clips)
    calls = []
    monkeypatch.setattr(publish, "modelscope_snapshot_download", lambda: fake_snapshot(bad, calls))
    result = oscar("validate", "ms:org/name@v2", "--format", "github")
    assert result.exit_code == 1 and calls[0]["revision"] == "v2" and calls[0]["repo_id"] == "org/name"
    errors = [parse_annotation(ln) for ln in result.stdout.splitlines() if ln.startswith("::")]
    assert len(errors) == 2 and all("file" not in p and p["title"] == "oscar validate: clips" for p, _ in errors)
    assert all(m.startswith("modelscope:org/name@v2: layers.") for _, m in errors)
    # a repository without artifacts, and one that cannot be downloaded: problems, not crashes
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "README.md").write_text("hi")
    monkeypatch.setattr(publish, "hf_snapshot_download", fake_snapshot(tmp_path / "empty", []))
    assert validate_hub("hf:org/empty")[0].problems == [
        "holds no oscar.safetensors: not an OSCAR artifact repository"]

    def offline(**kwargs):
        raise OSError("Network is unreachable")
    monkeypatch.setattr(publish, "hf_snapshot_download", offline)
    report = validate_hub("hf:org/name")[0]
    assert report.checks == {"download": False} and "Network is unreachable" in report.problems[0]


@pytest.mark.parametrize("source", ["hf:org/name@", "hf:org", "ms:org/na me", "hf:org/name@-x"])
def test_malformed_hub_sources_fail_before_any_download(tmp_path, monkeypatch, source):
    calls = []
    monkeypatch.setattr(publish, "hf_snapshot_download", fake_snapshot(make_artifact(tmp_path / "r"), calls))
    with pytest.raises(InputError):
        validate_sources(["hf:org/ok", source])
    assert calls == []


def test_an_existing_local_path_is_never_a_hub_source(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_artifact(tmp_path / "hf:org" / "name")
    assert not is_hub_source("hf:org/name") and is_hub_source("hf:org/other")
    assert [(str(r.path), r.ok) for r in validate_sources(["hf:org/name"])] == [("hf:org/name", True)]


def test_validate_zoo_calls_stale_what_make_test_calls_stale(tmp_path, monkeypatch):
    """A zoo entry re-verified in place (its verify.json's last digits moved) leaves the zoo's index
    stale: `oscar validate zoo` says so and exits 1, as the pre-commit hook `make test` runs does;
    `oscar zoo index` makes both agree it is current again."""
    shutil.copytree(REPO / "zoo", tmp_path / "zoo")
    monkeypatch.chdir(tmp_path)
    hook = ["validate", "--changed-files", "zoo/index.json"]
    assert oscar("validate", "zoo").exit_code == 0 and oscar(*hook).exit_code == 0
    verify = tmp_path / "zoo" / "smollm2-135m" / "verify.json"
    doc = json.loads(verify.read_text())
    doc["summary"]["mean_attn_error"] *= 1 + 1e-12
    verify.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    for args in (["validate", "zoo"], hook):
        result = oscar(*args)
        assert result.exit_code == 1 and "zoo/index.json: stale: it does not describe the artifacts beside it" \
            in result.stderr, (args, result.stderr)
    assert oscar("zoo", "index", "--zoo", "zoo").exit_code == 0
    assert oscar("validate", "zoo").exit_code == 0 and oscar(*hook).exit_code == 0
