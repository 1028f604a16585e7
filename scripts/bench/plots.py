"""The figures of ``docs/benchmarks.md``, drawn as SVG from the current results by ``report.py``.

Plain SVG text, written here rather than through a plotting library, so that a rendering is the
same bytes on every machine and version (``report.py --check`` and its test compare them, as they
compare the page). Three kinds, each a pure function of one result file:

* :func:`decode_time`: decode-attention time against context, INT2, BF16 SDPA and (where the run
  timed it) FlashInfer's BF16 decode, one panel per batch size (the one-call replay solid; in
  stream, the calls back to back, dashed);
* :func:`decode_bandwidth`: the same calls as a share of the measured copy bandwidth;
* :func:`step_profile`: a decode step's kernel time by category, INT2 against BF16 (stacked bars).
"""

from __future__ import annotations

import math
from html import escape

INT2, BF16, FLASHINFER = "#1f5fa8", "#d9641e", "#7b3294"
CATEGORY_COLOURS = ("#1f5fa8", "#d9641e", "#3a9a4b", "#8e44ad", "#b8860b", "#7f7f7f")
FONT = 'font-family="sans-serif" font-size="11"'


def _num(x: float) -> str:
    """A coordinate with one decimal, no trailing zeros (stable text)."""
    return f"{x:.1f}".rstrip("0").rstrip(".")


def _label(v: float) -> str:
    return f"{v:g}" if v < 1e4 else f"{v / 1e3:g}k"


def nice_ticks(top: float, count: int = 5) -> list[float]:
    """0 and multiples of a round step (1, 2, 2.5 or 5 times a power of ten) up to at least ``top``."""
    top = max(top, 1e-9)
    raw = top / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    n = math.ceil(top / step - 1e-9)
    return [round(i * step, 10) for i in range(n + 1)]


def _ctx(t: int) -> str:
    return f"{t // 1024}K" if t >= 1024 and t % 1024 == 0 else str(t)


def _svg(width: int, height: int, title: str, body: list[str]) -> str:
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" {FONT}>')
    return "\n".join([head, f"<title>{escape(title)}</title>", f'<rect width="{width}" height="{height}" fill="white"/>',
                      f'<text x="{_num(width / 2)}" y="18" text-anchor="middle" font-size="13">{escape(title)}</text>',
                      *body, "</svg>"]) + "\n"


def _panel(x0: float, y0: float, w: float, h: float, title: str, contexts: list[int], series: list[dict],
           ylabel: str) -> list[str]:
    """One line panel: x the context on a log scale (each doubling the same width), ``series`` of
    ``{"name", "colour", "dash", "ys"}`` (None for a missing point), y from 0 to a round top."""
    ticks = nice_ticks(max((y for s in series for y in s["ys"] if y is not None), default=1.0))
    top = ticks[-1]
    lo, hi = math.log2(min(contexts)), math.log2(max(contexts))
    span = max(hi - lo, 1.0)
    xlabels = [_ctx(c) for c in contexts]

    def px(i: int) -> float:
        return x0 + w * (0.08 + 0.84 * (math.log2(contexts[i]) - lo) / span)

    def py(v: float) -> float:
        return y0 + h - h * v / top

    out = [f'<text x="{_num(x0 + w / 2)}" y="{_num(y0 - 8)}" text-anchor="middle">{escape(title)}</text>',
           f'<text transform="translate({_num(x0 - 48)},{_num(y0 + h / 2)}) rotate(-90)" '
           f'text-anchor="middle">{escape(ylabel)}</text>']
    for t in ticks:
        out.append(f'<line x1="{_num(x0)}" y1="{_num(py(t))}" x2="{_num(x0 + w)}" y2="{_num(py(t))}" '
                   f'stroke="#e3e3e3"/>')
        out.append(f'<text x="{_num(x0 - 5)}" y="{_num(py(t) + 4)}" text-anchor="end">{_label(t)}</text>')
    out.append(f'<rect x="{_num(x0)}" y="{_num(y0)}" width="{_num(w)}" height="{_num(h)}" fill="none" '
               f'stroke="#888"/>')
    for i, lab in enumerate(xlabels):
        out.append(f'<text x="{_num(px(i))}" y="{_num(y0 + h + 15)}" text-anchor="middle">{escape(lab)}</text>')
    for s in series:
        pts = [(px(i), py(y)) for i, y in enumerate(s["ys"]) if y is not None]
        if not pts:
            continue
        dash = ' stroke-dasharray="5,3"' if s.get("dash") else ""
        out.append(f'<polyline fill="none" stroke="{s["colour"]}" stroke-width="2"{dash} points="'
                   + " ".join(f"{_num(x)},{_num(y)}" for x, y in pts) + '"/>')
        out += [f'<circle cx="{_num(x)}" cy="{_num(y)}" r="2.5" fill="{s["colour"]}"/>' for x, y in pts]
    return out


def _legend(x: float, y: float, series: list[dict]) -> list[str]:
    out = []
    for i, s in enumerate(series):
        yy = y + 15 * i
        dash = ' stroke-dasharray="5,3"' if s.get("dash") else ""
        out.append(f'<line x1="{_num(x)}" y1="{_num(yy)}" x2="{_num(x + 22)}" y2="{_num(yy)}" '
                   f'stroke="{s["colour"]}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{_num(x + 28)}" y="{_num(yy + 4)}">{escape(s["name"])}</text>')
    return out


def _decode_series(doc: dict, batch: int, value) -> tuple[list[int], list[dict]]:
    """Contexts of ``batch`` and the INT2 / SDPA series of ``value(row, side, stream)``."""
    rows = sorted((r for r in doc["rows"] if r["batch"] == batch and "int2_ms" in r), key=lambda r: r["context"])
    ctxs = [r["context"] for r in rows]
    stream = any("int2_stream_ms" in r for r in rows)
    series = [{"name": "INT2 (one call)", "colour": INT2, "ys": [value(r, "int2", False) for r in rows]},
              {"name": "BF16 SDPA (one call)", "colour": BF16, "ys": [value(r, "sdpa", False) for r in rows]}]
    fi = any("flashinfer_ms" in r for r in rows)
    if fi:
        series.append({"name": "FlashInfer BF16 (one call)", "colour": FLASHINFER,
                       "ys": [value(r, "flashinfer", False) for r in rows]})
    if stream:
        series += [{"name": "INT2 in stream", "colour": INT2, "dash": True, "ys": [value(r, "int2", True) for r in rows]},
                   {"name": "BF16 SDPA in stream", "colour": BF16, "dash": True,
                    "ys": [value(r, "sdpa", True) for r in rows]}]
        if fi:
            series.append({"name": "FlashInfer in stream", "colour": FLASHINFER, "dash": True,
                           "ys": [value(r, "flashinfer", True) for r in rows]})
    return ctxs, series


def _us(r: dict, side: str, stream: bool):
    v = r.get(f"{side}_stream_ms" if stream else f"{side}_ms")
    return None if v is None else v * 1e3


def decode_time(doc: dict) -> str:
    """Decode time (µs) against context, one panel per batch size."""
    batches = sorted({r["batch"] for r in doc["rows"] if "int2_ms" in r})
    pw, ph, gap, left = 300, 190, 90, 70
    width = left + len(batches) * pw + (len(batches) - 1) * gap + 190
    body, legend = [], []
    for k, b in enumerate(batches):
        ctxs, series = _decode_series(doc, b, _us)
        body += _panel(left + k * (pw + gap), 50, pw, ph, f"batch {b}", ctxs, series, "µs")
        legend = legend or series
    body += _legend(width - 175, 60, legend)
    body.append(f'<text x="{_num(left + (width - left - 190) / 2)}" y="{50 + ph + 36}" text-anchor="middle">'
                "context (tokens)</text>")
    fi = " and FlashInfer" if any("flashinfer_ms" in r for r in doc["rows"]) else ""
    return _svg(width, 50 + ph + 50, f"Decode attention on {doc['device_name']}: INT2 against BF16 SDPA{fi}", body)


def decode_bandwidth(doc: dict) -> str:
    """The decode calls' bytes read per second as a percentage of the copy bandwidth."""
    bw = doc["copy"]["bytes_per_s"]
    batches = sorted({r["batch"] for r in doc["rows"] if "int2_ms" in r})
    series, ctx_all = [], sorted({r["context"] for r in doc["rows"] if "int2_ms" in r})
    dashes = (False, True)
    for b, dash in zip(batches, dashes * len(batches)):
        rows = {r["context"]: r for r in doc["rows"] if r["batch"] == b and "int2_ms" in r}

        def pct(side, stream, rows=rows):
            out = []
            for c in ctx_all:
                r = rows.get(c)
                ms = None if r is None else r.get(f"{side}_stream_ms" if stream else f"{side}_ms")
                nbytes = None if r is None else r["int2_bytes" if side == "int2" else "bf16_bytes"]
                out.append(None if ms is None else 100 * nbytes / (ms * 1e-3) / bw)
            return out

        series += [{"name": f"INT2, batch {b}", "colour": INT2, "dash": dash, "ys": pct("int2", False)},
                   {"name": f"BF16 SDPA, batch {b}", "colour": BF16, "dash": dash, "ys": pct("sdpa", False)}]
        if any("flashinfer_ms" in r for r in rows.values()):
            series.append({"name": f"FlashInfer BF16, batch {b}", "colour": FLASHINFER, "dash": dash,
                           "ys": pct("flashinfer", False)})
        if any("int2_stream_ms" in r for r in rows.values()):
            series.append({"name": f"INT2 in stream, batch {b}", "colour": "#2a9d8f", "dash": dash,
                           "ys": pct("int2", True)})
    pw, ph, left = 420, 200, 70
    width = left + pw + 230
    key = "; ".join(f"{'dashed' if d else 'solid'}: batch {b}" for b, d in zip(batches, dashes * len(batches)))
    body = _panel(left, 50, pw, ph, key, ctx_all, series, "% of copy bandwidth")
    body += _legend(left + pw + 20, 60, series)
    body.append(f'<text x="{_num(left + pw / 2)}" y="{50 + ph + 36}" text-anchor="middle">context (tokens)</text>')
    return _svg(width, 50 + ph + 50, f"Decode attention on {doc['device_name']}: bytes read per second "
                f"over the copy bandwidth ({bw / 1e12:.2f} TB/s)", body)


def step_profile(doc: dict) -> str:
    """A compiled decode step's kernel time by category (ms), INT2 and BF16 per shape, stacked."""
    bars = []
    for p in doc["profile"]:
        for side, name in (("int2", "INT2"), ("bf16", "BF16")):
            if side in p:
                bars.append((f"{p['batch']} × {_ctx(p['tokens'])} {name}", p[side]["by_category_ms"]))
    cats = list(dict.fromkeys(c for _, by in bars for c in by))
    colour = {c: CATEGORY_COLOURS[i % len(CATEGORY_COLOURS)] for i, c in enumerate(cats)}
    left, pw, bh, gap = 130, 420, 18, 8
    ticks = nice_ticks(max(sum(by.values()) for _, by in bars))
    top = ticks[-1]
    y0 = 40
    h = len(bars) * (bh + gap)
    body = []
    for t in ticks:
        x = left + pw * t / top
        body.append(f'<line x1="{_num(x)}" y1="{y0}" x2="{_num(x)}" y2="{_num(y0 + h)}" stroke="#e3e3e3"/>')
        body.append(f'<text x="{_num(x)}" y="{_num(y0 + h + 14)}" text-anchor="middle">{_label(t)}</text>')
    for i, (label, by) in enumerate(bars):
        y = y0 + i * (bh + gap) + gap / 2
        body.append(f'<text x="{left - 6}" y="{_num(y + bh - 5)}" text-anchor="end">{escape(label)}</text>')
        x = float(left)
        for c in cats:
            w = pw * by.get(c, 0.0) / top
            if w > 0:
                body.append(f'<rect x="{_num(x)}" y="{_num(y)}" width="{_num(w)}" height="{bh}" '
                            f'fill="{colour[c]}"><title>{escape(c)}: {by[c]:.2f} ms</title></rect>')
            x += w
        body.append(f'<text x="{_num(x + 4)}" y="{_num(y + bh - 5)}">{sum(by.values()):.2f}</text>')
    body.append(f'<text x="{_num(left + pw / 2)}" y="{_num(y0 + h + 30)}" text-anchor="middle">'
                "kernel time per step, ms</text>")
    lx = left + pw + 50
    for i, c in enumerate(cats):
        body.append(f'<rect x="{lx}" y="{y0 + 15 * i}" width="12" height="10" fill="{colour[c]}"/>')
        body.append(f'<text x="{lx + 18}" y="{y0 + 15 * i + 9}">{escape(c)}</text>')
    return _svg(lx + 210, int(y0 + max(h, 15 * len(cats)) + 45),
                f"A compiled decode step on {doc['device_name']}: kernel time by category", body)


def figures(docs: list[dict]) -> dict[str, str]:
    """``{file name: SVG}`` for every result that has what a figure draws."""
    out = {}
    for doc in docs:
        slug = f"{doc['benchmark']}-{doc['device']}"
        if doc["benchmark"] == "kernels" and any("int2_ms" in r and "sdpa_ms" in r for r in doc.get("rows", [])):
            out[f"{slug}-time.svg"] = decode_time(doc)
            out[f"{slug}-bandwidth.svg"] = decode_bandwidth(doc)
        if doc["benchmark"] == "generate" and doc.get("profile"):
            out[f"{slug}-step.svg"] = step_profile(doc)
    return out
