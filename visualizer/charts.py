"""Line charts for measurements (lessons 04 and 08): costs against length, blocks over time.

    render_line_chart({"recompute": [(x, y), ...], "swap": [...]}, x_label=..., y_label=...)

Series are drawn in the palette's order; a legend sits under the plot, one entry per line, so
that labels never overlap the data or each other. ``log_y`` spaces the y axis by powers of ten,
for costs that differ by orders of magnitude. ``marks`` draws labelled vertical lines (a
crossover, an event). Elements for tests: ``series`` (``data-name``, ``data-points``),
``legend-entry`` (``data-name``) and ``mark`` (``data-x``).
"""
from __future__ import annotations

import math

from visualizer.svg import INK, MUTED, caption, colour, el, svg_root, text, to_string

PLOT_X, PLOT_W, PLOT_H = 70, 430, 200


def _ticks(lo: float, hi: float, log: bool) -> list[float]:
    if log:
        return [10.0 ** e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)]
    span = (hi - lo) or 1.0
    base = 10 ** math.floor(math.log10(span))
    # the largest "round" step (1, 2, 5 x 10^k) that still gives at least four ticks
    step = next(s for s in (5 * base, 2 * base, base, base / 2, base / 5) if span / s >= 4)
    start = math.ceil(lo / step) * step
    return [start + i * step for i in range(int((hi - start) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000 or abs(v) < 0.01:
        return f"{v:.0e}".replace("e+0", "e").replace("e-0", "e-")
    return f"{v:g}"


def render_line_chart(series: dict[str, list[tuple[float, float]]], title: str | None = None,
                      x_label: str = "", y_label: str = "", log_y: bool = False,
                      marks: list[tuple[float, str]] = (), step_lines: bool = False,
                      dashed: tuple[str, ...] = (), log_x: bool = False) -> str:
    """SVG line chart of ``series`` (name -> points). ``step_lines`` draws staircases (counts
    per step); names in ``dashed`` are drawn dashed (models, as opposed to measurements);
    ``log_x`` spaces the x axis logarithmically, with a tick at every x of the data."""
    points = [p for pts in series.values() for p in pts]
    if not points:
        raise ValueError("nothing to draw")
    xs = [x for x, _ in points]
    ys = [y for _, y in points if not log_y or y > 0]
    x_lo, x_hi = min(xs), max(xs)
    if log_y:
        y_lo, y_hi = 10 ** math.floor(math.log10(min(ys))), 10 ** math.ceil(math.log10(max(ys)))
    else:
        y_lo, y_hi = min(0.0, min(ys)), max(ys) * 1.05 or 1.0
    top = (40 if title else 14) + 14  # room for the y axis label above the plot
    legend_y = top + PLOT_H + 44
    height = legend_y + 16 * len(series) + 8
    width = PLOT_X + PLOT_W + 30
    root = svg_root(width, height, "line-chart", data_log_y=log_y)
    if title:
        caption(root, 10, 20, title)

    def sx(x: float) -> float:
        if log_x:
            span = (math.log(x_hi) - math.log(x_lo)) or 1
            return PLOT_X + (math.log(x) - math.log(x_lo)) / span * PLOT_W
        return PLOT_X + (x - x_lo) / ((x_hi - x_lo) or 1) * PLOT_W

    def sy(y: float) -> float:
        if log_y:
            y = max(y, y_lo)
            f = (math.log10(y) - math.log10(y_lo)) / ((math.log10(y_hi) - math.log10(y_lo)) or 1)
        else:
            f = (y - y_lo) / ((y_hi - y_lo) or 1)
        return top + PLOT_H - f * PLOT_H

    el(root, "rect", x=PLOT_X, y=top, width=PLOT_W, height=PLOT_H, fill="none", stroke=MUTED,
       stroke_width=0.6)
    for t in _ticks(y_lo, y_hi, log_y):
        if y_lo <= t <= y_hi:
            el(root, "line", x1=PLOT_X, y1=sy(t), x2=PLOT_X + PLOT_W, y2=sy(t), stroke="#eeeeee")
            text(root, PLOT_X - 4, sy(t) + 3, _fmt(t), size=9, anchor="end", fill=MUTED,
                 class_="tick")
    for t in (sorted(set(xs)) if log_x else _ticks(x_lo, x_hi, False)):
        if x_lo <= t <= x_hi:
            text(root, sx(t), top + PLOT_H + 12, _fmt(t), size=9, anchor="middle", fill=MUTED,
                 class_="tick")
    text(root, PLOT_X + PLOT_W / 2, top + PLOT_H + 28, x_label, size=10, anchor="middle")
    text(root, 10, top - 10, y_label, size=10)

    for x, label in marks:
        g = el(root, "g", class_="mark", data_x=x)
        el(g, "line", x1=sx(x), y1=top, x2=sx(x), y2=top + PLOT_H, stroke="#d62728",
           stroke_dasharray="3 3")
        anchor = "end" if sx(x) > PLOT_X + PLOT_W / 2 else "start"
        text(g, sx(x) + (-4 if anchor == "end" else 4), top + 12, label, size=9, anchor=anchor,
             fill="#d62728")

    for i, (name, pts) in enumerate(series.items()):
        pts = sorted(pts)
        coords = []
        for k, (x, y) in enumerate(pts):
            if step_lines and k:
                coords.append((sx(x), sy(pts[k - 1][1])))
            coords.append((sx(x), sy(y)))
        g = el(root, "g", class_="series", data_name=name, data_points=len(pts))
        el(g, "polyline", points=" ".join(f"{x:.1f},{y:.1f}" for x, y in coords), fill="none",
           stroke=colour(i), stroke_width=2, stroke_dasharray="5 3" if name in dashed else None)
        if not step_lines:
            for x, y in pts:
                el(g, "circle", cx=sx(x), cy=sy(y), r=2.5, fill=colour(i))
        entry = el(root, "g", class_="legend-entry", data_name=name)
        ly = legend_y + 16 * i
        el(entry, "line", x1=PLOT_X, y1=ly - 4, x2=PLOT_X + 24, y2=ly - 4, stroke=colour(i),
           stroke_width=2, stroke_dasharray="5 3" if name in dashed else None)
        text(entry, PLOT_X + 30, ly, name, size=10, fill=INK)
    return to_string(root)
