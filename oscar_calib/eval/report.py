"""Evaluation results: the result type, text tables, headline numbers, recording into an artifact, plots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError


@dataclass
class EvalResult:
    task: str
    model_id: str
    settings: dict
    rows: list[dict]
    timings: dict = field(default_factory=dict)

    def summary(self) -> list[dict]:
        """ppl: one row per method; niah: one row per method with accuracy per length, each with its
        95% Wilson interval (``interval``, ``by_length_interval``) and prompt count (``by_length_n``)."""
        if self.task == "ppl":
            return self.rows
        from .stats import wilson_interval

        ci = lambda v: [round(x, 4) for x in wilson_interval(sum(v), len(v))]  # noqa: E731
        out = []
        for m in dict.fromkeys(r["method"] for r in self.rows):
            rs = [r for r in self.rows if r["method"] == m]
            by_len = {}
            for r in rs:
                by_len.setdefault(r["length"], []).append(r["score"])
            scores = [r["score"] for r in rs]
            out.append({"method": m, "accuracy": sum(scores) / len(rs), "samples": len(rs), "interval": ci(scores),
                        "by_length": {str(k): sum(v) / len(v) for k, v in sorted(by_len.items())},
                        "by_length_interval": {str(k): ci(v) for k, v in sorted(by_len.items())},
                        "by_length_n": {str(k): len(v) for k, v in sorted(by_len.items())},
                        "bits_per_element": rs[0]["bits_per_element"]})
        return out

    def to_json(self) -> dict:
        return {"task": self.task, "model_id": self.model_id, "settings": self.settings, "summary": self.summary(),
                "rows": self.rows, "timings": self.timings}


def eval_text(results: dict) -> str:
    """Plain-text tables of recorded results (``{task: EvalResult.to_json()}``), for model cards."""
    lines = []
    ppl = results.get("ppl")
    if ppl:
        s = ppl["settings"]
        lines.append(f"held-out perplexity: {s['sequences']} x {s['seq_len']} tokens of {s['data']}, "
                     f"BF16 sink {s['sink']} + recent {s['recent']} per query position, INT2 history")
        lines.append(f"{'method':<12}{'bits/elem':>10}{'group':>7}{'perplexity':>12}{'gap closed':>12}")
        for r in ppl["rows"]:
            gap = f"{r['gap_closed_vs_hadamard']:+.0%}" if "gap_closed_vs_hadamard" in r else "-"
            lines.append(f"{r['method']:<12}{r['bits_per_element']:>10.3f}{group_label(r):>7}"
                         f"{r['ppl']:>12.3f}{gap:>12}")
        lines.append("gap closed: share of the Hadamard -> BF16 perplexity gap closed; quanto: transformers "
                     "QuantizedCache (2 bits, residual 128, group 64)")
        if s.get("fork"):
            lines.append(fork_note(s["fork"]))
    long = results.get("long")
    if long:
        if lines:
            lines.append("")
        lines += context_text(long)
    niah = results.get("niah")
    if niah:
        s = niah["settings"]
        if lines:
            lines.append("")
        lengths = list(niah["summary"][0]["by_length"]) if niah["summary"] else []
        lines.append(f"needle in a haystack (exact match, 95% Wilson interval): depths {s['depths']}, {s['samples']} "
                     f"sample(s) each ({len(s['depths']) * s['samples']} prompts per length), haystack {s['haystack']}, "
                     "generate() through the cache" + (f" on {s['device']}" if s.get("device") else ""))
        lines.append(f"{'method':<12}{'bits/elem':>10}" + "".join(f"{k:>19}" for k in lengths) + f"{'all':>19}")
        for r in niah["summary"]:
            lines.append(f"{r['method']:<12}{r['bits_per_element']:>10.3f}"
                         + "".join(f"{_rate(r, k):>19}" for k in lengths) + f"{_rate(r):>19}")
        if s.get("fork"):
            lines.append(fork_note(s["fork"]))
    return "\n".join(lines)


def context_caption(result: dict) -> str:
    """What a long-context perplexity result (``oscar eval --context``, its JSON) measured, in one
    sentence."""
    s = result["settings"]
    scored = s.get("scored") or {}
    counts = sorted(set(scored.values())) if isinstance(scored, dict) else [scored]
    paths = sorted(set((s.get("paths") or {}).values()))
    return (f"held-out perplexity at long contexts: the last {' / '.join(f'{n:,}' for n in counts)} predictions of "
            f"{s['sequences']} window(s) of each length of {s['data']}, the rest of each window prefilled at full "
            f"precision; BF16 sink {s['sink']} + recent {s['recent']}, INT2 history"
            + (f"; scored through {', '.join(paths)}" if paths else ""))


def context_cells(result: dict) -> tuple[list[str], list[list[str]]]:
    """The long-context table of a result's JSON: headers and one row per method (its history's
    bits per element, then per length its perplexity, its distance to BF16 and the bits the real
    cache holds at that length with its windows counted)."""
    lengths = result["settings"]["contexts"]
    by = {(r["method"], r["context"]): r for r in result["rows"]}
    methods = list(dict.fromkeys(r["method"] for r in result["rows"]))
    headers = ["method", "bits/elem"] + [f"ppl at {n:,} (vs BF16; bits with windows)" for n in lengths]
    rows = []
    for m in methods:
        first = next(r for r in result["rows"] if r["method"] == m)
        cells = [m, f"{first['bits_per_element']:.3f}"]
        for n in lengths:
            r = by.get((m, n))
            if r is None:
                cells.append("-")
                continue
            rel = f"{r['vs_bf16']:+.2%}" if "vs_bf16" in r and m != "bf16" else ""
            bits = f"{r['bits_at_context']:.2f} b" if "bits_at_context" in r and m != "bf16" else ""
            extra = "; ".join(x for x in (rel, bits) if x)
            cells.append(f"{r['ppl']:.3f}" + (f" ({extra})" if extra else ""))
        rows.append(cells)
    return headers, rows


def context_text(result: dict) -> list[str]:
    """Plain-text lines of a long-context result (for model cards)."""
    headers, rows = context_cells(result)
    widths = [max(len(h), *(len(r[i]) for r in rows)) + 2 for i, h in enumerate(headers)]
    fmt = lambda cells: "".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return [context_caption(result), fmt(headers).rstrip(), *(fmt(r).rstrip() for r in rows)]


def _rate(row: dict, length: str | None = None) -> str:
    """``0.62 [0.48, 0.74]`` for a NIAH summary row (one length, or all); a result recorded before
    intervals existed shows the rate alone."""
    from .stats import format_rate

    rate = row["accuracy"] if length is None else row["by_length"][length]
    ci = row.get("interval") if length is None else (row.get("by_length_interval") or {}).get(length)
    return format_rate(rate, ci) if ci else f"{rate:.2f}"


def fork_note(fork: dict) -> str:
    """One line saying what the ``fork`` rows ran with (a result's ``settings["fork"]``)."""
    q = fork.get("quantizer")
    storage = q if isinstance(q, str) else "float32 scale/zero"
    return (f"fork: the OSCAR SGLang fork's scheme for this artifact: {fork.get('rotations', 'one rotation per layer')}, "
            f"clips k={fork['k_clip']:g} v={fork['v_clip']:g} for the whole model, group {fork['group_size']}, "
            f"BF16 sink {fork['sink']} + recent {fork['recent']}, {storage}")


def group_label(row: dict) -> str:
    """A result row's group column: its size, ``32-256`` for per-layer sizes (a bit budget), or -."""
    sizes = row.get("layer_group_sizes")
    if sizes:
        flat = [g for pair in sizes for g in pair]
        return f"{min(flat)}-{max(flat)}"
    return str(row.get("group_size") or "-")


def eval_headline(results: dict) -> dict:
    """The few numbers a model card and the zoo table show: perplexity of every method,
    the artifact's bits per element, and NIAH accuracy per method (nested)."""
    out: dict = {}
    ppl = results.get("ppl")
    if ppl:
        for r in ppl["rows"]:
            out[f"{r['method']}_ppl"] = round(r["ppl"], 3)
            if r["method"] in ("oscar", "fork"):
                out[f"{r['method']}_bits_per_element"] = r["bits_per_element"]
    long = results.get("long")
    if long:
        out["long_ppl"] = {str(n): {r["method"]: round(r["ppl"], 3) for r in long["rows"] if r["context"] == n}
                           for n in long["settings"]["contexts"]}
    niah = results.get("niah")
    if niah:
        out["niah"] = {r["method"]: round(r["accuracy"], 3) for r in niah["summary"]}
        out["niah"]["lengths"] = niah["settings"]["lengths"]
        intervals = {r["method"]: r["interval"] for r in niah["summary"] if "interval" in r}
        if intervals:
            out["niah_interval"] = intervals
            out["niah_prompts"] = {r["method"]: r["samples"] for r in niah["summary"]}
    return out


def record_eval(artifact_dir: Path, result: EvalResult, *, serving: list[dict] | None = None) -> None:
    """Store ``result`` in the artifact's ``calibration.json``: the full result under
    ``eval_results[task]`` (plus ``eval_results["text"]``, the tables as text) and the headline
    numbers under ``eval`` (what the model card and ``oscar zoo`` show); then rewrite the model
    card. The rotations file is not touched.

    A long-context perplexity result (``oscar eval --context``) is its own table, stored under
    ``eval_results["long"]`` (headline ``long_ppl``: perplexity per length and method); it never
    replaces the main one.

    A perplexity result that includes another engine's method (``vllm``, ``llamacpp``) is the
    card's "what each engine costs" table: it is stored under ``eval_results["engines"]``. Its
    other methods (``bf16``, ``naive``, ``hadamard``, ``oscar``, ``fork``...) also replace the main
    ``ppl`` table when they include ``bf16`` and every method that table has (so one run can fill
    both); otherwise the main table stays as it was. ``serving``
    (:func:`oscar_calib.tools.export.serving_table`) is stored beside it as ``engine_serving``.

    A long-context or NIAH result is also drawn beside the card (``CARD_PLOTS``: perplexity or
    needle retrieval against context length), and the card shows that picture."""
    import json

    from ..contract.card import model_card
    from ..contract.layout import CARD_NAME, CARD_PLOTS, REPORT_NAME
    from ..fsutil import atomic_write_text

    directory = Path(artifact_dir)
    path = directory / REPORT_NAME
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"cannot record the evaluation: {path} is not readable ({e})") from None
    from .methods import ENGINE_METHODS

    results = report.setdefault("eval_results", {})
    long = result.task == "ppl" and bool(result.settings.get("contexts"))
    engines = result.task == "ppl" and not long and any(r["method"] in ENGINE_METHODS for r in result.rows)
    key = "long" if long else "engines" if engines else result.task
    results[key] = result.to_json()
    if key in CARD_PLOTS:                   # the card shows it: drawn from the result it stores
        write_plot(directory / CARD_PLOTS[key], result)
    if engines:
        own = [r for r in result.rows if r["method"] not in ENGINE_METHODS]
        names = {r["method"] for r in own}
        have = {r["method"] for r in results.get("ppl", {}).get("rows", [])}
        if len(own) > 1 and "bf16" in names and have <= names:
            methods = [m for m in result.settings.get("methods", []) if m not in ENGINE_METHODS]
            results["ppl"] = EvalResult("ppl", result.model_id, dict(result.settings, methods=methods), own,
                                        result.timings).to_json()
    if serving is not None:
        report["engine_serving"] = serving
    results["text"] = eval_text(results)
    report["eval"] = eval_headline(results)
    stored = json.dumps(report, indent=2, sort_keys=True) + "\n"
    atomic_write_text(path, stored)
    # the card is drawn from the report as stored (sorted keys), so it is the card that
    # calibration.json generates and `oscar validate` recognises it as unedited
    atomic_write_text(directory / CARD_NAME, model_card(json.loads(stored)))


PLOT_COLORS = {"bf16": "#888", "oscar": "#c55", "fork": "#e93", "fork-lloyd": "#eb7", "vllm": "#5a8",
               "llamacpp": "#86b"}


def _legend_outside(ax) -> None:
    """The legend right of the axes, where it hides no point."""
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)


def write_plot(path: Path, result: EvalResult) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    from ..fsutil import atomic_write_bytes

    if result.task == "ppl" and result.settings.get("contexts"):
        fig, ax = plt.subplots(figsize=(6.5, 3.6), constrained_layout=True)
        lengths = result.settings["contexts"]
        for m in dict.fromkeys(r["method"] for r in result.rows):
            pts = sorted((r["context"], r["ppl"]) for r in result.rows if r["method"] == m)
            ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=m, color=PLOT_COLORS.get(m))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")                  # a 2-bit cache's gap is a ratio; Hadamard's would flatten it
        ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        ax.set_xticks(lengths, [f"{n:,}" for n in lengths])
        ax.minorticks_off()
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("perplexity of the last tokens (log)")
        ax.set_title(f"{result.model_id}\nthe last predictions of long windows; BF16 sink {result.settings['sink']} + "
                     f"recent {result.settings['recent']}", fontsize=9)
        _legend_outside(ax)
    elif result.task == "ppl":
        fig, ax = plt.subplots(figsize=(6.5, 3.6), constrained_layout=True)
        rows = result.rows
        names = [f"{r['method']}\n{r['bits_per_element']:.2f} b" for r in rows]
        vals = [r["ppl"] for r in rows]
        bars = ax.bar(names, vals, color=[PLOT_COLORS.get(r["method"], "#58a") for r in rows])
        for bar, v in zip(bars, vals):
            ax.annotate(f"{v:.2f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("held-out perplexity (log)")
        fork = result.settings.get("fork")
        ax.set_title(f"{result.model_id}: sink {result.settings['sink']} + recent {result.settings['recent']} BF16, "
                     f"group {result.settings['group_size']}"
                     + (f"\nfork: one rotation per layer, clips {fork['k_clip']:g}/{fork['v_clip']:g}, group "
                        f"{fork['group_size']}, sink {fork['sink']} + recent {fork['recent']}, fp32 scales"
                        if fork else ""), fontsize=9)
    else:
        fig, ax = plt.subplots(figsize=(6.5, 3.6), constrained_layout=True)
        summ = result.summary()
        for i, s in enumerate(summ):
            shift = 2 ** (0.04 * (i - (len(summ) - 1) / 2))     # side by side, so the error bars stay apart
            xs = [int(k) * shift for k in s["by_length"]]
            ys = list(s["by_length"].values())
            lo = [max(0.0, y - s["by_length_interval"][k][0]) for k, y in zip(s["by_length"], ys)]
            hi = [max(0.0, s["by_length_interval"][k][1] - y) for k, y in zip(s["by_length"], ys)]
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o-", capsize=3, label=s["method"],
                        color=PLOT_COLORS.get(s["method"]))
        ax.set_xscale("log", base=2)
        lengths = sorted({int(k) for s in summ for k in s["by_length"]})
        ax.set_xticks(lengths, [f"{n:,}" for n in lengths])
        ax.minorticks_off()
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("NIAH exact match (95% interval)")
        ax.set_title(f"{result.model_id}: needle retrieval through the KV cache", fontsize=9)
        _legend_outside(ax)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buf.getvalue())
