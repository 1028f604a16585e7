"""Every command ends, for people, with one line on stderr saying what to run next; --json and
OSCAR_PROGRESS=off leave it out. Commands that load a model run on a tiny checkpoint (slow)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from factories import oscar

import oscar_calib.tools.publish as publish
from oscar_calib.tools.export.sglang.export import FORK_INSTALL

ZOO = Path(__file__).resolve().parents[2] / "zoo" / "smollm2-135m"


def next_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("next: ")]


@pytest.fixture
def artifact(tmp_path) -> Path:
    """A copy of the committed SmolLM2 artifact (valid, with shared rotations and fork clips)."""
    return Path(shutil.copytree(ZOO, tmp_path / "smollm2"))


@pytest.fixture(autouse=True)
def progress_on(monkeypatch):
    monkeypatch.delenv("OSCAR_PROGRESS", raising=False)


def test_validate_ends_with_verify_and_nothing_with_json_or_progress_off(monkeypatch, capsys, artifact):
    code, _, err = oscar("validate", str(artifact))
    assert code == 0 and next_lines(err) == [f"next: oscar verify {artifact} measures it on its model with the INT2 "
                                             "kernels (about 1 min on 2 CPU cores)"]
    assert err.strip().splitlines()[-1].startswith("next: ")            # the last line
    code, out, err = oscar("validate", str(artifact), "--json")
    assert code == 0 and json.loads(out)["ok"] and next_lines(err) == []
    monkeypatch.setenv("OSCAR_PROGRESS", "off")
    assert next_lines(oscar("validate", str(artifact))[2]) == []


def test_an_invalid_artifact_gets_its_problems_only(monkeypatch, capsys, artifact):
    (artifact / "oscar.safetensors").write_bytes((artifact / "oscar.safetensors").read_bytes()[:4000])
    code, _, err = oscar("validate", str(artifact))
    assert code == 1 and next_lines(err) == [] and "truncated" in err


def test_export_points_at_launch_and_the_fork(monkeypatch, capsys, artifact, tmp_path):
    out = tmp_path / "serve"
    code, _, err = oscar("export", str(artifact), "--out", str(out))
    assert code == 0, err
    assert next_lines(err) == [f"next: {out / 'launch.sh'} starts the server on a GPU with the OSCAR SGLang fork "
                               f"installed ({FORK_INSTALL})"]


def test_push_dry_run_and_pull(monkeypatch, capsys, artifact, tmp_path):
    code, _, err = oscar("push", str(artifact), "--to", "hf:my-org/x", "--dry-run")
    files = sum(1 for p in artifact.iterdir() if p.is_file())
    assert code == 0 and next_lines(err) == [f"next: the same command without --dry-run uploads {files} files to "
                                             "hf:my-org/x"]

    def download(**kwargs):
        for f in artifact.iterdir():
            shutil.copy(f, Path(kwargs["local_dir"]) / f.name)

    monkeypatch.setenv("OSCAR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(publish, "hf_snapshot_download", download)
    code, _, err = oscar("pull", "hf:my-org/x")
    dest = tmp_path / "cache" / "zoo" / "hf" / "my-org" / "x"
    assert code == 0 and next_lines(err) == [f"next: oscar verify {dest} measures it on its model with the INT2 "
                                             "kernels (about 1 min on 2 CPU cores) (--model if not its own)"]


@pytest.mark.slow
def test_calibrate_verify_eval_fold_each_say_what_comes_next(monkeypatch, capsys, tmp_path, tiny_dir):
    art, folded = tmp_path / "art", tmp_path / "folded"
    fast = ["--tokens", "256", "--seq-len", "64", "--heldout-tokens", "32", "--device", "cpu"]
    code, out, err = oscar("calibrate", str(tiny_dir), "--out", str(art), *fast, "--no-verify")
    assert code == 0, err
    assert next_lines(err) == [f"next: oscar verify {art} checks the artifact with the INT2 kernels (minutes on a CPU "
                               f"for a model of 100M parameters), then oscar eval "
                               f"{tiny_dir} {art}"]
    # the time line: every stage and "other", adding up to the total printed
    line = [x for x in out.splitlines() if x.startswith("time: ")][0]
    parts, total = line[len("time: "):].split("; total ")
    secs = [float(p.rsplit(" ", 2)[1]) for p in parts.split(", ")]
    assert parts.split(", ")[-1].startswith("other ") and round(sum(secs), 1) == float(total.removesuffix(" s"))

    code, _, err = oscar("verify", str(art), "--depths", "64", "--sequences", "1",
                            "--backend", "torch", "--device", "cpu")
    assert code in (0, 1) and len(next_lines(err)) == 1         # a random-init model may fail verify's comparison
    assert next_lines(err)[0].startswith(f"next: oscar eval {tiny_dir} {art}" if code == 0 else
                                         f"next: see the reasons above; more calibration text often helps: oscar "
                                         f"calibrate {tiny_dir} --tokens 32768 --out {art} --overwrite")

    code, _, err = oscar("eval", str(tiny_dir), str(art), "--methods", "bf16,oscar",
                            "--sequences", "1", "--seq-len", "64", "--sink", "8", "--recent", "8", "--device", "cpu",
                            "--plot", str(tmp_path / "p.png"))
    assert code == 0, err
    assert next_lines(err)[0].startswith(f"next: add --record to store these results in {art}'s card")

    code, _, err = oscar("fold-weights", str(tiny_dir), str(art), "--out", str(folded),
                            "--device", "cpu")
    assert code == 0, err
    assert next_lines(err)[0].startswith(f"next: oscar export {folded / 'oscar'} --out serve/folded")


def test_validate_zoo_names_a_model_that_is_installed_and_the_pip_line_of_one_that_is_not(monkeypatch, tmp_path):
    """A zoo: verify the entry of the default model (make setup installs it); a pip-shipped model
    that is not installed is named with its install line, first when nothing else can run."""
    import oscar_calib.model.source as source

    zoo = Path(shutil.copytree(ZOO.parent, tmp_path / "zoo"))
    gemma, smol = source.ALIASES["gemma3-270m"]["pip"], source.ALIASES["smollm2-135m"]["pip"]
    only = (" (about 1 min on 2 CPU cores); a zoo entry is only measured, --record rewrites its verify.json and the "
            "zoo's index")
    monkeypatch.setattr(source, "wheel_missing", lambda spec: None)
    assert next_lines(oscar("validate", str(zoo))[2]) == [f"next: oscar verify {zoo / 'smollm2-135m'} measures it on "
                                                          f"its model with the INT2 kernels{only}"]
    monkeypatch.setattr(source, "wheel_missing", lambda spec: gemma if spec == "gemma3-270m" else None)
    assert next_lines(oscar("validate", str(zoo))[2]) == [f"next: oscar verify {zoo / 'smollm2-135m'} measures it on "
                                                          f"its model with the INT2 kernels{only}; "
                                                          f"{zoo / 'gemma3-270m'} needs its model first: {gemma}"]
    monkeypatch.setattr(source, "wheel_missing", lambda spec: {"gemma3-270m": gemma, "smollm2-135m": smol}[spec])
    (line,) = next_lines(oscar("validate", str(zoo / "gemma3-270m"))[2])
    assert line.startswith(f"next: {gemma} installs its model, then oscar verify {zoo / 'gemma3-270m'} measures it")


def test_a_failed_verification_of_a_zoo_entry_calibrates_into_runs(tmp_path):
    """The advice after a failed verify never overwrites a committed zoo entry."""
    from oscar_calib.cli._common import more_data_hint

    zoo = Path(shutil.copytree(ZOO.parent, tmp_path / "zoo"))
    assert "--out runs/smollm2-135m --overwrite" in more_data_hint("smollm2-135m", zoo / "smollm2-135m")
    assert f"--out {tmp_path / 'mine'} --overwrite" in more_data_hint("smollm2-135m", tmp_path / "mine")
    assert "--tokens 32768 " in more_data_hint("smollm2-135m", tmp_path / "mine")
