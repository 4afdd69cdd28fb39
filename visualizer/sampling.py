"""Next-token distributions and one step of beam search, drawn (lesson 10).

    render_token_bars(labels, {"T = 0.5": [p, ...], "T = 1": [...]}, dropped={...},
                      cumulative=[...], threshold=(0.8, "top_p = 0.8"))
    render_beam_step(beam_candidates(call, request_id, per_beam), decode=tokenizer.decode)

Bars are grouped by token, one colour per series, the legend under the plot. A token a filter
dropped is drawn as a dashed outline (its logit became -inf, its probability 0). Elements for
tests: ``bar`` (``data-series``, ``data-token``, ``data-p``, ``data-dropped``),
``legend-entry`` (``data-name``), ``cumulative``, ``threshold`` (``data-value``); in the beam
step ``beam`` (``data-seq``, ``data-cum``) and ``candidate`` (``data-token``, ``data-score``,
``data-kept``).
"""
from __future__ import annotations

from collections.abc import Callable

from visualizer.charts import _fmt, _ticks
from visualizer.svg import (HIGHLIGHT, INK, MUTED, caption, colour, el, shorten, svg_root, text,
                            to_string)

PLOT_X, PLOT_H, BAR_W, GAP = 70, 200, 14, 14
KEPT_FILL, DROPPED_FILL = "#59a14f", "#f4f4f4"


def render_token_bars(labels: list[str], series: dict[str, list[float]],
                      title: str | None = None, x_label: str = "next token",
                      y_label: str = "probability",
                      dropped: dict[str, set[int]] | None = None,
                      cumulative: list[float] | None = None,
                      threshold: tuple[float, str] | None = None) -> str:
    """SVG bar chart: for each token (``labels``), one bar per series (its probability).

    ``dropped[name]`` holds the token positions that series' filter removed (dashed outline);
    ``cumulative`` draws the running sum of the first series as a line, and ``threshold`` a
    horizontal line (value, label), e.g. top_p.
    """
    if not labels or not series:
        raise ValueError("nothing to draw")
    dropped = dropped or {}
    group_w = BAR_W * len(series) + GAP
    plot_w = group_w * len(labels)
    values = [v for vs in series.values() for v in vs] + list(cumulative or [])
    y_hi = max(max(values), threshold[0] if threshold else 0.0) * 1.05 or 1.0
    top = (40 if title else 14) + 14
    label_h = 8 + 6.6 * max(len(lab) for lab in labels) * 0.72  # rotated token labels
    legend_names = list(series) + (["dropped by the filter (probability 0)"] if dropped else []) \
        + (["running sum"] if cumulative else [])
    legend_y = top + PLOT_H + label_h + 34
    width = max(PLOT_X + plot_w + 30, 520)
    height = legend_y + 16 * len(legend_names) + 8
    root = svg_root(width, height, "token-bars")
    if title:
        caption(root, 10, 20, title)

    def sy(y: float) -> float:
        return top + PLOT_H - y / y_hi * PLOT_H

    el(root, "rect", x=PLOT_X, y=top, width=plot_w, height=PLOT_H, fill="none", stroke=MUTED,
       stroke_width=0.6)
    for t in _ticks(0.0, y_hi, False):
        if 0 <= t <= y_hi:
            el(root, "line", x1=PLOT_X, y1=sy(t), x2=PLOT_X + plot_w, y2=sy(t), stroke="#eeeeee")
            text(root, PLOT_X - 4, sy(t) + 3, _fmt(t), size=9, anchor="end", fill=MUTED,
                 class_="tick")
    text(root, 10, top - 10, y_label, size=10)
    text(root, PLOT_X + plot_w / 2, top + PLOT_H + label_h + 18, x_label, size=10,
         anchor="middle")

    for k, label in enumerate(labels):
        x0 = PLOT_X + k * group_w + GAP / 2
        lx, ly = x0 + BAR_W * len(series) / 2, top + PLOT_H + 10
        text(root, lx, ly, label, size=10, anchor="end", transform=f"rotate(-45 {lx} {ly})",
             class_="token-label")
        for i, (name, probs) in enumerate(series.items()):
            p = probs[k]
            gone = k in dropped.get(name, ())
            g = el(root, "g", class_="bar", data_series=name, data_token=label,
                   data_p=f"{p:.6f}", data_dropped=gone)
            x, h = x0 + i * BAR_W, max(p / y_hi * PLOT_H, 0.0)
            if gone:  # the filter set this token's logit to -inf: an outline where it stood
                el(g, "rect", x=x + 1, y=sy(p), width=BAR_W - 2, height=max(h, 1.0),
                   fill="white", stroke=colour(i), stroke_dasharray="3 2", stroke_width=1.2)
            else:
                el(g, "rect", x=x + 1, y=sy(p), width=BAR_W - 2, height=h, fill=colour(i))

    if cumulative:
        pts = [(PLOT_X + k * group_w + group_w / 2, sy(c)) for k, c in enumerate(cumulative)]
        g = el(root, "g", class_="cumulative")
        el(g, "polyline", points=" ".join(f"{x:.1f},{y:.1f}" for x, y in pts), fill="none",
           stroke=INK, stroke_width=1.5)
        for x, y in pts:
            el(g, "circle", cx=x, cy=y, r=2.5, fill=INK)
    if threshold:
        value, label = threshold
        g = el(root, "g", class_="threshold", data_value=value)
        el(g, "line", x1=PLOT_X, y1=sy(value), x2=PLOT_X + plot_w, y2=sy(value),
           stroke=HIGHLIGHT, stroke_dasharray="5 3")
        text(g, PLOT_X + plot_w - 4, sy(value) - 4, label, size=10, anchor="end",
             fill=HIGHLIGHT)

    for i, name in enumerate(legend_names):
        entry = el(root, "g", class_="legend-entry", data_name=name)
        ly = legend_y + 16 * i
        if name in series:
            el(entry, "rect", x=PLOT_X, y=ly - 9, width=24, height=10,
               fill=colour(list(series).index(name)))
        elif name == "running sum":
            el(entry, "line", x1=PLOT_X, y1=ly - 4, x2=PLOT_X + 24, y2=ly - 4, stroke=INK,
               stroke_width=1.5)
        else:
            el(entry, "rect", x=PLOT_X, y=ly - 9, width=24, height=10, fill="white",
               stroke=MUTED, stroke_dasharray="3 2")
        text(entry, PLOT_X + 30, ly, name, size=10, fill=INK)
    return to_string(root)


def render_beam_step(beams: list[dict], decode: Callable[[list[int]], str] = str,
                     title: str | None = None) -> str:
    """SVG of one beam-search step: a column per live beam (its text so far and cumulative
    logprob), under it its best next tokens with their score (cumulative + token logprob).
    Candidates the sampler kept are green, with the sequence that continues them."""
    if not beams:
        raise ValueError("nothing to draw")
    col_w, box_h, head_h = 250, 34, 46
    per_beam = max(len(b["candidates"]) for b in beams)
    width = 20 + col_w * len(beams)
    top = 40 if title else 14
    cand_y = top + head_h + 26
    legend_y = cand_y + per_beam * (box_h + 8) + 18
    height = legend_y + 2 * 16 + 8
    root = svg_root(width, height, "beam-step")
    if title:
        caption(root, 10, 20, title)
    for b, beam in enumerate(beams):
        x = 10 + b * col_w
        g = el(root, "g", class_="beam", data_seq=beam["seq_id"],
               data_cum=f"{beam['cumulative_logprob']:.4f}")
        el(g, "rect", x=x, y=top, width=col_w - 14, height=head_h, rx=4, fill="#eef3f8",
           stroke=colour(0))
        so_far = decode(beam["output_token_ids"]) if beam["output_token_ids"] else "(prompt)"
        text(g, x + 6, top + 16, shorten(f"seq {beam['seq_id']}: {so_far!r}", 32), size=10)
        text(g, x + 6, top + 34, f"cumulative logprob {beam['cumulative_logprob']:.2f}",
             size=10, fill=MUTED)
        for c, cand in enumerate(beam["candidates"]):
            y = cand_y + c * (box_h + 8)
            kept = cand["kept_as"] is not None
            node = el(root, "g", class_="candidate", data_token=cand["token"],
                      data_score=f"{cand['score']:.4f}", data_kept=kept,
                      data_beam=beam["seq_id"])
            el(node, "line", x1=x + 12, y1=top + head_h, x2=x + 12, y2=y + box_h / 2,
               stroke=MUTED, stroke_width=0.8)
            el(node, "line", x1=x + 12, y1=y + box_h / 2, x2=x + 22, y2=y + box_h / 2,
               stroke=MUTED, stroke_width=0.8)
            el(node, "rect", x=x + 22, y=y, width=col_w - 36, height=box_h, rx=4,
               fill=KEPT_FILL if kept else DROPPED_FILL, stroke=INK if kept else MUTED)
            ink = "white" if kept else INK
            token = shorten(repr(decode([cand["token"]])), 14)
            text(node, x + 28, y + 14, f"+ {token}", size=10, fill=ink, weight="bold")
            text(node, x + 28, y + 28, f"{cand['logprob']:.2f} -> score {cand['score']:.2f}",
                 size=10, fill=ink)
            if kept:
                text(node, x + col_w - 20, y + 14, f"seq {cand['kept_as']}", size=10,
                     anchor="end", fill=ink)
    entries = [("kept: among the best scores of all beams' candidates", KEPT_FILL, INK),
               ("dropped", DROPPED_FILL, MUTED)]
    for i, (name, fill, stroke) in enumerate(entries):
        entry = el(root, "g", class_="legend-entry", data_name=name)
        ly = legend_y + 16 * i
        el(entry, "rect", x=10, y=ly - 9, width=24, height=10, fill=fill, stroke=stroke)
        text(entry, 40, ly, name, size=10)
    return to_string(root)
