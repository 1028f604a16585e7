"""NIAH that decides something: >= 50 prompts per context length through the real cache, on the GPU.

Runs ``oscar eval --task niah``'s evaluation (:func:`oscar_calib.eval.evaluate_niah`: full-precision
prefill, then ``model.generate()`` through each method's cache; on CUDA the INT2 methods decode
through the real :class:`~oscar_calib.runtime.OscarCache` with the Triton kernels, each answer
from a CUDA graph, ``graph_decoding``) for bf16, hadamard and oscar (``--methods``), plus
``oscar-new``, a second artifact's scheme on the same prompts (``--new-artifact``), one context
length at a time, and writes one EvalResult JSON (``oscar eval --json``'s shape, with a 95% Wilson
interval per method x length) after every length, so a run cut short keeps what it had. The table
printed last (with exact McNemar tests between every pair of methods) is what the docs show.

The filler is ``prose`` by default: English sentences generated from a committed grammar
(:mod:`oscar_calib.eval.haystack`), the same bytes on every Python, checked against its committed
sha256 before anything runs (the ``corpus`` filler follows the interpreter's pydoc data, so the
prompts moved between machines). The result records the filler's full sha256.

    # on the GPU machine (GGUF files carried in parts and re-assembled; see --gguf)
    python scripts/experiments/niah_gpu.py smollm2-135m zoo/smollm2-135m --gguf /root/m/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --lengths 1024,2048,4096,8192 --prompts 50 --out $OUT/niah_smollm2-135m_h100.json
    python scripts/experiments/niah_gpu.py --quick                     # CPU check of the whole script (tiny lengths)
    python scripts/experiments/niah_gpu.py --merge OUT.json A.json B.json      # lengths run in separate calls
    python scripts/experiments/niah_gpu.py --merge NEW.json --baselines OLD.json --out OUT.json   # reuse bf16/hadamard
    python scripts/experiments/niah_gpu.py --record scripts/experiments/results/niah_smollm2-135m_h100.json zoo/smollm2-135m

Getting the models there: a run carries at most 64 MiB of working tree and the GPU machine has no
network and no ``gguf`` package. Here: ``xz -6`` each GGUF (SmolLM2 98 -> 90 MB, Gemma 253 -> 238
MB), ``split -b 47513348`` into parts, and copy them with the gguf wheel (``pip download gguf``)
into ``.gpu/<name>/`` of the checkout that travels. There: one part per run into ``/root/m/``
(files under /root survive while the machine stays warm, about 30 s after a run: make the calls
back to back), then ``cat part* | xz -d > /root/m/FILE.gguf``, ``pip install --target /root/site``
the wheel, and run this script with ``PYTHONPATH=/root/site`` and ``--gguf /root/m/FILE.gguf``.
Eight calls (five only copying a part, three runs, two of them carrying a model's last part) took
15.6 min of device time (2026-11-23).

``--record`` stores the result in the artifact (``calibration.json`` and its model card, as
``oscar eval --record`` does) after checking that the artifact's ``oscar.safetensors`` is the one
the run used (sha256 recorded in the JSON's settings). An artifact that ran as ``oscar-new``
(``--new-artifact``) is recorded with those rows as its ``oscar`` method.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

METHODS = "bf16,hadamard,oscar"
NEW_METHOD = "oscar-new"
DEPTHS = "0,0.25,0.5,0.75,1"


def artifact_sha256(artifact: Path) -> str:
    return hashlib.sha256((Path(artifact) / "oscar.safetensors").read_bytes()).hexdigest()


def load(alias: str, gguf: str | None, device: str, dtype: str):
    """The model by alias, or from a GGUF file carried to this machine (recorded under the alias'
    model id, so the result belongs to the same model as the artifact)."""
    import dataclasses

    from oscar_calib.model.load import load_model
    from oscar_calib.model.source import ALIASES

    if gguf is None:
        return load_model(alias, device=device, dtype=dtype)
    lm = load_model(gguf, device=device, dtype=dtype)
    if alias in ALIASES:
        lm.source = dataclasses.replace(lm.source, model_id=ALIASES[alias]["model_id"])
    return lm


def check_artifact(path: Path, lm) -> tuple[object, bool]:
    """The validated artifact, and whether its model fingerprint matches (a geometry mismatch is fatal;
    a fingerprint that differs only by the config keys another transformers version writes is reported)."""
    from oscar_calib.contract.artifact import compatibility_problems, load_artifact
    from oscar_calib.errors import ArtifactError

    art = load_artifact(path)
    geometry = compatibility_problems(art.metadata, lm.geometry, None, model_name=lm.source.model_id)
    if geometry:
        raise ArtifactError(f"{path}: {geometry[0]}")
    match = not compatibility_problems(art.metadata, lm.geometry, lm.fingerprint)
    if not match:
        print(f"note: {path}: model fingerprint differs (config keys of this transformers version); geometry matches",
              flush=True)
    return art, match


def merge(results: list[dict]) -> dict:
    """One result from runs of the same model, methods, depths and samples at different lengths."""
    from oscar_calib.eval import EvalResult

    first = results[0]["settings"]
    same = ("methods", "depths", "samples", "seed", "haystack", "haystack_sha256", "sink", "recent", "artifact_sha256",
            "new_artifact_sha256")
    for r in results[1:]:
        diff = [k for k in same if r["settings"].get(k) != first.get(k)]
        if diff or r["model_id"] != results[0]["model_id"]:
            raise SystemExit(f"error: cannot merge results that differ in {', '.join(diff) or 'model'}")
    rows = [row for r in results for row in r["rows"]]
    lengths = sorted({row["length"] for row in rows})
    settings = dict(first, lengths=lengths)
    timings = {"total_s": sum(r["timings"].get("total_s", 0.0) for r in results),
               "per_length_s": {k: v for r in results for k, v in r["timings"].get("per_length_s", {}).items()}}
    return EvalResult("niah", results[0]["model_id"], settings, rows, timings).to_json()


# the methods whose answers do not depend on an artifact: an earlier run's rows of them, on the same
# prompts, stand for a new run's (``--baselines``)
BASELINE_METHODS = ("bf16", "naive", "hadamard")


def with_baselines(result: dict, base: dict, base_path: str = "") -> dict:
    """``result`` (a run of the artifact's methods only) completed with ``base``'s rows of
    :data:`BASELINE_METHODS` at the same lengths: the prompts must be the same (model, depths,
    samples, seed, filler and its hash, windows), or this refuses in one line. The settings name
    where the baselines came from (file, device, command)."""
    from oscar_calib.eval import EvalResult

    mine, theirs = result["settings"], base["settings"]
    same = ("depths", "samples", "seed", "haystack", "haystack_sha256", "sink", "recent")
    diff = [k for k in same if mine.get(k) != theirs.get(k)]
    if diff or result["model_id"] != base["model_id"]:
        raise SystemExit(f"error: {base_path or 'the baselines'} ran other prompts ({', '.join(diff) or 'model'} "
                         "differ): its baselines cannot stand for this run's")
    lengths = sorted({r["length"] for r in result["rows"]})
    have = {m for m in BASELINE_METHODS if any(r["method"] == m for r in result["rows"])}
    rows = [r for r in base["rows"] if r["method"] in BASELINE_METHODS and r["method"] not in have
            and r["length"] in lengths]
    missing = [n for n in lengths if not any(r["length"] == n for r in rows)] if rows else lengths
    if missing:
        raise SystemExit(f"error: {base_path or 'the baselines'} has no baseline rows at length(s) {missing}")
    taken = sorted({r["method"] for r in rows}, key=BASELINE_METHODS.index)
    settings = dict(mine, methods=[*taken, *mine.get("methods", [])],
                    baselines_from={"file": base_path, "methods": taken, "device": theirs.get("device"),
                                    "command": theirs.get("command")})
    return EvalResult("niah", result["model_id"], settings, rows + result["rows"], result["timings"]).to_json()


def table(result: dict) -> str:
    """Method x length with 95% intervals, then the paired tests against each method's neighbours."""
    from oscar_calib.eval.stats import format_rate, paired_p_value

    summ = result["summary"]
    lengths = list(summ[0]["by_length"]) if summ else []
    lines = [f"{result['model_id']}: NIAH exact match, {summ[0]['samples'] // max(1, len(lengths))} prompts per length"
             if summ else "no rows"]
    lines.append(f"{'method':<10}" + "".join(f"{k:>20}" for k in lengths) + f"{'all':>20}")
    for s in summ:
        lines.append(f"{s['method']:<10}" + "".join(f"{format_rate(s['by_length'][k], s['by_length_interval'][k]):>20}"
                                                    for k in lengths)
                     + f"{format_rate(s['accuracy'], s['interval']):>20}")
    scores = {}
    for row in result["rows"]:
        scores.setdefault((row["method"], row["length"]), []).append(row["score"])
    methods = [s["method"] for s in summ]
    lines.append("paired exact McNemar p (same prompts), per length and over all lengths:")
    for i, a in enumerate(methods):
        for b in methods[i + 1:]:
            ps = [paired_p_value(scores[(a, int(k))], scores[(b, int(k))]) for k in lengths]
            every_a = [x for k in lengths for x in scores[(a, int(k))]]
            every_b = [x for k in lengths for x in scores[(b, int(k))]]
            lines.append(f"  {a} vs {b}: " + " ".join(f"{p:.3f}" for p in ps)
                         + f" | all {paired_p_value(every_a, every_b):.3g}")
    return "\n".join(lines)


def run(args) -> None:
    import torch

    from oscar_calib.eval import EvalOptions, EvalResult, evaluate_niah
    from oscar_calib.fsutil import atomic_write_text

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if args.haystack == "prose":
        from oscar_calib.eval.haystack import PROSE_SHA256, prose_sha256

        if prose_sha256() != PROSE_SHA256:
            raise SystemExit(f"error: the prose filler here hashes to {prose_sha256()}, not the committed "
                             f"{PROSE_SHA256}; the prompts would differ from every other run")
    t0 = time.perf_counter()
    lm = load(args.model, args.gguf, device, args.dtype)
    load_s = time.perf_counter() - t0
    print(f"loaded {lm.source.model_id} on {device} in {load_s:.1f} s", flush=True)
    art, fingerprint_ok = check_artifact(Path(args.artifact), lm)
    extra = {}
    if args.new_artifact:
        from oscar_calib.runtime.scheme import KVScheme

        new_art, _ = check_artifact(Path(args.new_artifact), lm)
        extra[NEW_METHOD] = KVScheme.from_artifact(new_art, name=NEW_METHOD, logit_correction=args.logit_correction)
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    opts = EvalOptions(task="niah", methods=args.methods, depths=depths, prompts=args.prompts, seed=args.seed,
                       lengths=lengths, haystack=args.haystack)
    rows, per_length, skipped = [], {}, []
    settings = None
    out = Path(args.out)
    for length in lengths:
        spent = time.perf_counter() - t0
        if per_length and args.deadline_s:
            last_len, last_s = list(per_length.items())[-1]
            guess = last_s * max(1.0, (length / int(last_len)) ** 0.5)
            if spent + guess > args.deadline_s:
                skipped.append(length)
                print(f"skip {length}: {spent:.0f} s spent, about {guess:.0f} s more would pass --deadline-s", flush=True)
                continue
        t = time.perf_counter()
        res = evaluate_niah(lm, opts.replace(lengths=(length,)), artifact=art, graph=args.graph,
                            extra_schemes=extra)
        per_length[str(length)] = round(time.perf_counter() - t, 2)
        rows += res.rows
        settings = dict(res.settings, lengths=sorted({r["length"] for r in rows}), artifact=str(args.artifact),
                        artifact_sha256=artifact_sha256(Path(args.artifact)), fingerprint_match=fingerprint_ok,
                        new_artifact=args.new_artifact,
                        new_artifact_sha256=artifact_sha256(Path(args.new_artifact)) if args.new_artifact else None,
                        haystack_text_sha256=_text_sha256(args.haystack),
                        device=torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
                        dtype=str(next(lm.model.parameters()).dtype).removeprefix("torch."),
                        backend="triton" if device.startswith("cuda") else "torch",
                        command=" ".join(sys.argv[1:]), skipped_lengths=skipped,
                        logit_correction_override=args.logit_correction)
        result = EvalResult("niah", lm.source.model_id, settings, rows,
                            {"total_s": round(time.perf_counter() - t0, 2), "load_s": round(load_s, 2),
                             "per_length_s": per_length}).to_json()
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps(result, indent=1) + "\n")
        acc = {s["method"]: s["accuracy"] for s in result["summary"] if str(length) in s["by_length"]}
        print(f"length {length}: {per_length[str(length)]:.1f} s; "
              + " ".join(f"{m} {s['by_length'][str(length)]:.2f}" for m, s in
                         ((s["method"], s) for s in result["summary"]) if m in acc), flush=True)
    if settings is None:
        raise SystemExit("error: no length ran")
    print(table(json.loads(out.read_text())))
    print(f"wrote {out}")


def _text_sha256(haystack: str) -> str:
    """Full sha256 of the filler text the prompts were cut from."""
    from oscar_calib.eval.niah import filler_text

    return hashlib.sha256(filler_text(haystack).encode("utf-8")).hexdigest()


def record(paths: list[str], artifact: str, force: bool, baselines: str | None = None) -> None:
    from oscar_calib.eval import EvalResult, record_eval

    results = [json.loads(Path(p).read_text()) for p in paths]
    merged = merge(results) if len(results) > 1 else results[0]
    if baselines:
        merged = with_baselines(merged, json.loads(Path(baselines).read_text()), baselines)
    settings, rows = merged["settings"], merged["rows"]
    want, have = settings.get("artifact_sha256"), artifact_sha256(Path(artifact))
    if settings.get("logit_correction_override") is not None and have == settings.get("new_artifact_sha256") \
            and not force:
        raise SystemExit(f"error: {NEW_METHOD} ran with --logit-correction {settings['logit_correction_override']:g}, "
                         f"not what {artifact} stores; record a run of what it stores")
    if have == settings.get("new_artifact_sha256"):
        # ARTIFACT ran as the second artifact: its rows become this card's ``oscar`` (the first
        # artifact's rows belong to another card and are left out)
        rows = [dict(r, method="oscar") if r["method"] == NEW_METHOD else r for r in rows if r["method"] != "oscar"]
        settings = dict(settings, artifact=settings["new_artifact"], artifact_sha256=have, new_artifact=None,
                        new_artifact_sha256=None, recorded_from=NEW_METHOD,
                        methods=[m for m in settings.get("methods", []) if m != NEW_METHOD])
    elif want != have and not force:
        raise SystemExit(f"error: {artifact}/oscar.safetensors (sha256 {have[:12]}…) is not the artifact the run used "
                         f"({str(want)[:12]}…); re-run the NIAH with this artifact, or pass --force to record anyway")
    result = EvalResult("niah", merged["model_id"], settings, rows, merged["timings"])
    record_eval(Path(artifact), result)                 # draws the card's needle plot too
    print(table(result.to_json()))
    print(f"recorded in {artifact}/calibration.json and its README.md")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="smollm2-135m", help="model alias (smollm2-135m, gemma3-270m)")
    p.add_argument("artifact", nargs="?", help="artifact directory (for oscar and fork)")
    p.add_argument("--gguf", help="the alias' GGUF file at this path (a machine without its wheel)")
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--depths", default=DEPTHS)
    p.add_argument("--prompts", type=int, default=50, help="at least this many prompts per length")
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--new-artifact", help=f"a second artifact, run as method {NEW_METHOD!r} on the same prompts")
    p.add_argument("--logit-correction", type=float, default=None,
                   help=f"the gain of the logit-noise correction for {NEW_METHOD!r} (default: its artifact's)")
    p.add_argument("--haystack", default="prose", help="NIAH filler: prose (default; the same text everywhere), "
                   "corpus or noise")
    p.add_argument("--graph", action=argparse.BooleanOptionalAction, default=True,
                   help="decode the INT2 methods' answers from CUDA graphs (graph_decoding)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--deadline-s", type=float, default=0.0, help="start no length predicted to end after this")
    p.add_argument("--out", default="niah_out/niah.json")
    p.add_argument("--quick", action="store_true", help="tiny lengths and prompts (checks the script on the CPU)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="write OUT (--out) merged from these results")
    p.add_argument("--record", nargs="+", metavar="JSON", help="record these results (merged) into ARTIFACT")
    p.add_argument("--force", action="store_true", help="--record even if the artifact differs from the run's")
    p.add_argument("--baselines", metavar="JSON", help="with --merge/--record: take bf16/naive/hadamard rows from an "
                   "earlier run of the same prompts (a run of the artifact's methods only)")
    args = p.parse_args(argv)
    if args.record:
        if len(args.record) < 2:
            raise SystemExit("error: --record JSON [JSON ...] ARTIFACT")
        *jsons, artifact = args.record
        return record(jsons, artifact, args.force, args.baselines)
    if args.merge:
        from oscar_calib.fsutil import atomic_write_text

        merged = merge([json.loads(Path(x).read_text()) for x in args.merge])
        if args.baselines:
            merged = with_baselines(merged, json.loads(Path(args.baselines).read_text()), args.baselines)
        atomic_write_text(Path(args.out), json.dumps(merged, indent=1) + "\n")
        print(table(merged))
        return print(f"wrote {args.out}")
    if args.quick:
        args.lengths, args.depths, args.prompts = "300,500", "0,1", 2
    if args.artifact is None:
        args.artifact = f"zoo/{args.model}"
    run(args)


if __name__ == "__main__":
    main()
