"""The model card (README.md) written beside every artifact."""

from __future__ import annotations

import json

from .features import layer_span
from .layout import CARD_PLOTS


def model_card(report: dict) -> str:
    s, g, cal, summ = report["settings"], report["geometry"], report["calibration"], report["summary"]
    clips = "fitted per layer and KV head" if cal["clip"] == "fit" else f"fixed k={s['k_clip']}, v={s['v_clip']}"
    lines = [
        "---",
        "library_name: oscar",
        "tags: [kv-cache, quantization, int2, oscar]",
        *([f"base_model: {hub_id(report)}"] if hub_id(report) else []),
        "---",
        "",
        f"# OSCAR rotations for {report['model_id']}",
        "",
        "Offline Spectral Covariance-Aware Rotations for a 2-bit KV cache, written by the `oscar` toolkit "
        f"{report['toolkit_version']} (artifact format v{report['format_version']}).",
        "",
        "| setting | value |",
        "|---|---|",
        f"| base model | `{report['model_id']}`{_where(report)} (fingerprint `{report['model_fingerprint'][:16]}…`) |",
        f"| geometry | {_geometry(g)} |",
        f"| method | K objective `{s['k_objective']}`, V objective `{s['v_objective']}`, composition `{s['composition']}`, granularity `{s['granularity']}` |",
        f"| quantisation | INT2 per token, {_groups(report)}, BF16 sink {s['sink_tokens']} + recent {s['recent_tokens']} tokens |",
        f"| clips | {clips} |",
        *([f"| key centering | every key stored as `(k − k_mean) @ k_rotation`, `k_mean` the calibration's mean "
           f"post-RoPE key per layer and KV head{_center_windows(cal)}; {_center_fit(s)}; `oscar export` names every "
           "engine that does not subtract it |"] if s.get("center_keys") else []),
        f"| calibration data | {cal['data']}, {cal['tokens']} tokens in {cal['sequences']} sequences of ≤{cal['seq_len']}, seed {cal['seed']} |",
        *([f"| content digest | `{report['content_sha256']}` (sha256 of the tensors and metadata; `verify.json` records "
           "the digest it verified) |"] if report.get("content_sha256") else []),
        "",
        "## Measured quality (held-out rows, every token INT2)",
        "",
        "Relative RMS error of the attention output with K and V quantised, mean over layers:",
        "",
        "| method | error |",
        "|---|---|",
        f"| this artifact | {summ['mean_attn_error_oscar']:.4f} |",
        f"| Hadamard, clips 0.96/0.92 | {summ['mean_attn_error_hadamard']:.4f} |",
        *([f"| the OSCAR SGLang fork's scheme: one rotation per layer, clips "
           f"k={report['fork_clips'][0]:g}, v={report['fork_clips'][1]:g} for the whole model "
           f"| {summ['mean_attn_error_fork']:.4f} |"] if "mean_attn_error_fork" in summ and report.get("fork_clips") else []),
        "",
        f"Better than Hadamard on {summ['layers_better_than_hadamard']} of {summ['num_layers']} layers. "
        "Per-layer figures are in `calibration.json`.",
        "",
    ]
    lines += _eval_section(report)
    lines += _engines_section(report)
    lines += _use_section(report)
    return "\n".join(lines)


def _center_fit(settings: dict) -> str:
    """What a centered artifact's rotations, clips and group sizes were fitted on (``center_fit``;
    a report written before the setting existed fitted them on the centered keys)."""
    if settings.get("center_fit", "centered") == "raw":
        return "rotations, clips and group sizes fitted on the raw keys, as without centering (`center_fit: raw`)"
    return "rotations, clips and group sizes fitted on the centered keys (`center_fit: centered`)"


def _center_windows(cal: dict) -> str:
    """`` over N-token windows`` when the mean key came from a pass of its own (``center_seq_len``)."""
    n = cal.get("center_seq_len")
    return f" over {n:,}-token windows (`center_seq_len`)" if n else ""


def hub_id(report: dict) -> str | None:
    """The model's hub id, when known: the ``model_source`` record's, else a ``model_id`` of the
    form ORG/NAME from an artifact without one. Never a local folder's name."""
    src = report.get("model_source")
    if isinstance(src, dict):
        return src.get("hub_id")
    model_id = str(report.get("model_id", ""))
    return model_id if model_id.count("/") == 1 and not model_id.startswith((".", "/", "~")) else None


def _where(report: dict) -> str:
    """`` (local directory `/abs/path`, a copy of `org/name`)`` for a model read from disk."""
    src = report.get("model_source")
    if not isinstance(src, dict) or src.get("kind") not in ("local", "gguf"):
        return ""
    what = "GGUF file" if src["kind"] == "gguf" else "local directory"
    copy = f", a copy of `{src['hub_id']}`" if src.get("hub_id") else ""
    return f" ({what} `{src.get('path')}`{copy})"


def _use_section(report: dict) -> list[str]:
    """``## Use``: loading the base model and an ``OscarCache`` in Python (the MODEL argument that
    loads it here: a pip-shipped model's alias, its path, or its hub id), the sink + recent rule,
    and the command line."""
    load = report.get("model_load") or {"model": report["model_id"]}
    model = json.dumps(load["model"])                   # a Python string literal, double-quoted
    s = report["settings"]
    sink, recent = s["sink_tokens"], s["recent_tokens"]
    return [
        "## Use",
        "",
        *([f"The base model loads with `load_model({model})`: {load['note']}.", ""] if load.get("note") else []),
        "```python",
        "from oscar_calib.model.load import load_model",
        "from oscar_calib.runtime import OscarCache",
        "",
        f"lm = load_model({model})",
        'cache = OscarCache.from_artifact("<this directory>", lm.model)',
        'ids = lm.tokenizer("The capital of France is", return_tensors="pt")',
        "with cache.attach(lm.model):",
        "    out = lm.model.generate(**ids, past_key_values=cache, max_new_tokens=32)",
        "print(lm.tokenizer.decode(out[0]))",
        "```",
        "",
        f"Attention reads INT2 only for tokens outside the BF16 windows (the first {sink} tokens and the latest "
        f"{recent}): a sequence of at most {sink} + {recent} = {sink + recent} tokens, prompt and generated tokens "
        "together, never reaches INT2.",
        "",
        "```",
        "oscar verify <this directory>",
        f"oscar fold-weights {load['model']} <this directory> --out folded/",
        "oscar export <this directory> --out serve/      # the OSCAR SGLang fork: serve/launch.sh",
        "```",
        "",
    ]


_EVAL_LABELS = (("bf16", "BF16 KV cache"), ("naive", "naive INT2"), ("hadamard", "Hadamard (QuaRot-INT2), clips 0.96/0.92"),
                ("oscar", "**this artifact**"),
                ("fork", "this artifact as the OSCAR SGLang fork serves it (one rotation per layer, global clips)"),
                ("fork-lloyd", "the same with the fork's Lloyd-Max buckets"),
                ("quanto", "transformers QuantizedCache (quanto, 2 bits)"))


def _needle(rate, interval) -> str:
    if rate is None:
        return "–"
    return f"{rate:.0%} [{interval[0]:.0%}, {interval[1]:.0%}]" if interval else f"{rate:.0%}"


def _eval_section(report: dict) -> list[str]:
    """``## Evaluation``: the headline numbers ``oscar eval --record`` stored under ``eval`` as a
    table, then the full text tables (``eval_results["text"]``)."""
    ev = report.get("eval")
    results = report.get("eval_results") or {}
    text = results.get("text")
    if not ev and not text:
        return []
    lines = ["## Evaluation", ""]
    if isinstance(ev, dict):
        niah = ev.get("niah") if isinstance(ev.get("niah"), dict) else {}
        ci = ev.get("niah_interval") if isinstance(ev.get("niah_interval"), dict) else {}
        rows = [(label, ev.get(f"{m}_ppl"), niah.get(m), ci.get(m)) for m, label in _EVAL_LABELS
                if f"{m}_ppl" in ev or m in niah]
        if rows:
            lines += ["| KV cache | held-out perplexity | needle retrieval |", "|---|---|---|"]
            lines += [f"| {label} | {'–' if p is None else f'{p:.3f}'} | {_needle(a, interval)} |"
                      for label, p, a, interval in rows]
            extra = []
            if "oscar_bits_per_element" in ev:
                extra.append(f"This artifact stores {ev['oscar_bits_per_element']:g} bits per element of the INT2 history"
                             + (f" ({ev['fork_bits_per_element']:g} in the fork, which keeps float32 scales)."
                                if "fork_bits_per_element" in ev else "."))
            if niah.get("lengths"):
                prompts = (ev.get("niah_prompts") or {}).get("oscar")
                extra.append(f"Needle retrieval: exact match over lengths {', '.join(str(x) for x in niah['lengths'])}"
                             + (f" ({prompts} prompts per method, 95% Wilson interval in brackets)." if prompts else "."))
            lines += ["", *([" ".join(extra), ""] if extra else [])]
            if niah.get("lengths") and "niah" in results:
                lines += [f"![Needle retrieval against context length, per KV cache, with 95% intervals]"
                          f"({CARD_PLOTS['niah']})", ""]
        long = ev.get("long_ppl") if isinstance(ev.get("long_ppl"), dict) else {}
        at = sorted(((n, v) for n, v in long.items() if isinstance(v, dict) and "oscar" in v and "bf16" in v),
                    key=lambda nv: int(nv[0]))              # the stored keys sort as text: "16384" < "8192"
        if at:
            lines += ["Perplexity at long contexts (the last tokens of long windows, table below): "
                      + "; ".join(f"{int(n):,} tokens: BF16 {v['bf16']:.3f}, this artifact {v['oscar']:.3f} "
                                  f"({v['oscar'] / v['bf16'] - 1:+.1%})" for n, v in at) + ".", ""]
            if "long" in results:
                lines += [f"![Perplexity of the last tokens of long windows against context length, per KV cache]"
                          f"({CARD_PLOTS['long']})", ""]
    if text:
        lines += ["Measured with `oscar eval` (full tables):", "", "```", text, "```", ""]
    elif ev and not isinstance(ev, dict):
        lines += ["```", str(ev), "```", ""]
    return lines


def _groups(report: dict) -> str:
    """``group G``, or the per-layer sizes of a bit budget (the keys' and the values' when they differ)
    with their cost and the uniform alternative."""
    b = report.get("bit_budget")
    v = (b or {}).get("layer_v_group_sizes")
    if not b or (all(g == report["group_size"] for g in b["layer_group_sizes"]) and not v):
        return f"group {report['group_size']}"
    sizes = (f"key group size per layer {', '.join(map(str, b['layer_group_sizes']))}, value group size per layer "
             f"{', '.join(map(str, v))}" if v and v != b["layer_group_sizes"]
             else f"group size per layer {', '.join(map(str, b['layer_group_sizes']))}")
    return (f"{sizes} (bit budget {b['bits']:g}: "
            f"{b['mean_bits']:.3f} bits per element, {b['long_bits']:.3f} at long contexts; an engine with one size "
            f"serves group {b['uniform_group_size']}, {b['uniform_bits']:g} bits)")


# what each engine's scheme is, for the engine-cost table (the methods of ``oscar eval``)
_ENGINE_ROWS = (("bf16", "BF16 KV cache (reference)"),
                ("oscar", "**this artifact** in oscar's own cache (per-KV-head rotations and clips, fp16 scales)"),
                ("fork", "the OSCAR SGLang fork (`--target sglang-fork`; upstream SGLang's `sglang` loads the same "
                         "files): one rotation per layer in BF16, one K and one V clip, float32 scales"),
                ("vllm", "vLLM (`--target vllm`): one rotation per layer, one INT2 group per head vector with fp16 "
                         "scale and minimum, no BF16 window, first and last two layers in BF16"),
                ("llamacpp", "llama.cpp (`--target llamacpp`): `q2_0` (mean-subtracted 128-value chunks, 4 Lloyd-Max "
                             "levels per 32 values), one clip ratio for K and V, F16 window, `q8_0` query"))


def _engines_section(report: dict) -> list[str]:
    """``## What each engine costs``: the perplexity of this artifact as each engine serves it
    (``oscar eval --methods bf16,oscar,fork,vllm,llamacpp --record``, stored under
    ``eval_results["engines"]``) and, per engine, the commands that serve it or why it cannot
    (``engine_serving``, :func:`oscar_calib.tools.export.serving_table`)."""
    res = (report.get("eval_results") or {}).get("engines")
    serving = report.get("engine_serving")
    if not res and not serving:
        return []
    lines = ["## What each engine costs", ""]
    if res:
        s = res["settings"]
        by = {r["method"]: r for r in res["rows"]}
        ref = by.get("oscar")
        lines += [f"Held-out perplexity ({s['sequences']} × {s['seq_len']} tokens of {s['data']}) with the KV cache "
                  "each engine would keep for this artifact, simulated from the exported settings:", "",
                  "| engine's scheme | bits/elem | perplexity | vs this artifact |", "|---|---|---|---|"]
        for m, label in _ENGINE_ROWS:
            r = by.get(m)
            if r is None:
                continue
            gap = f"{r['ppl'] / ref['ppl'] - 1:+.1%}" if ref and m not in ("oscar", "bf16") else "–"
            lines.append(f"| {label} | {r['bits_per_element']:.2f} | {r['ppl']:.3f} | {gap} |")
        lines += ["", "Bits per element average every layer (vLLM's two BF16 boundary layers at each end count 16). "
                  "An engine listed as refused below cannot serve this model today; its row says what its scheme "
                  "would cost if it could.", ""]
    if serving:
        lines += ["Serving commands (each engine's loader rules checked against the revision named):", ""]
        for row in serving:
            lines.append(f"**{row['engine']}** (`--target {row['target']}`, {row['checked']}, {row['status']}):")
            lines.append("")
            if row.get("refused"):
                lines += [f"refused: {row['refused']}", ""]
                continue
            block = [row["export"]]
            if row.get("argv"):
                block += [f"{k}={v}" for k, v in row["env"].items()] + [" ".join(row["argv"])]
            block += [f"# {n}" for n in row.get("notes") or [] if not row.get("argv")]
            lines += ["```", *block, "```", ""]
            lines += [f"- warning: {w}" for w in row.get("warnings") or []]
            lines += [""] if row.get("warnings") else []
    return lines


def _geometry(g: dict) -> str:
    """The geometry row: layers (a hybrid's attention layers and their ids), heads, head_dim (per layer
    where layers differ)."""
    layers = f"{g['num_layers']} layers"
    if g.get("layer_ids"):
        layers = f"{g['num_layers']} attention layers (the model's layers {layer_span(g['layer_ids'])})"
    if g.get("layer_head_dims"):
        shapes = sorted(set(zip(g["layer_kv_heads"], g["layer_head_dims"])), key=lambda hd: hd[1])
        heads = " / ".join(f"{h} KV heads of {d}" for h, d in shapes)
        return f"{layers}, {g['num_attention_heads']} query heads; {heads} by layer"
    return f"{layers}, {g['num_attention_heads']} query / {g['num_kv_heads']} KV heads, head_dim {g['head_dim']}"
