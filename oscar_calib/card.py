"""The model card (README.md) written beside every artifact."""

from __future__ import annotations


def model_card(report: dict) -> str:
    s, g, cal, summ = report["settings"], report["geometry"], report["calibration"], report["summary"]
    clips = "fitted per layer and KV head" if cal["clip"] == "fit" else f"fixed k={s['k_clip']}, v={s['v_clip']}"
    lines = [
        "---",
        "library_name: oscar",
        "tags: [kv-cache, quantization, int2, oscar]",
        f"base_model: {report['model_id']}",
        "---",
        "",
        f"# OSCAR rotations for {report['model_id']}",
        "",
        "Offline Spectral Covariance-Aware Rotations for a 2-bit KV cache, written by the `oscar` toolkit "
        f"{report['toolkit_version']} (artifact format v{report['format_version']}).",
        "",
        "| setting | value |",
        "|---|---|",
        f"| base model | `{report['model_id']}` (fingerprint `{report['model_fingerprint'][:16]}…`) |",
        f"| geometry | {g['num_layers']} layers, {g['num_attention_heads']} query / {g['num_kv_heads']} KV heads, head_dim {g['head_dim']} |",
        f"| method | K objective `{s['k_objective']}`, V objective `{s['v_objective']}`, composition `{s['composition']}`, granularity `{s['granularity']}` |",
        f"| quantisation | INT2 per token, group {report['group_size']}, BF16 sink {s['sink_tokens']} + recent {s['recent_tokens']} tokens |",
        f"| clips | {clips} |",
        f"| calibration data | {cal['data']}, {cal['tokens']} tokens in {cal['sequences']} sequences of ≤{cal['seq_len']}, seed {cal['seed']} |",
        "",
        "## Measured quality (held-out rows, every token INT2)",
        "",
        "Relative RMS error of the attention output with K and V quantised, mean over layers:",
        "",
        "| method | error |",
        "|---|---|",
        f"| this artifact | {summ['mean_attn_error_oscar']:.4f} |",
        f"| Hadamard, clips 0.96/0.92 | {summ['mean_attn_error_hadamard']:.4f} |",
        "",
        f"Better than Hadamard on {summ['layers_better_than_hadamard']} of {summ['num_layers']} layers. "
        "Per-layer figures are in `calibration.json`.",
        "",
    ]
    ev = report.get("eval")
    if ev:
        lines += ["## Evaluation", "", "```", str(ev), "```", ""]
    lines += [
        "## Use",
        "",
        "```",
        "oscar verify <this directory> --model <base model>",
        "oscar fold-weights <base model> <this directory> --out folded/",
        "```",
        "",
    ]
    return "\n".join(lines)
