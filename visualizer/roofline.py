"""The roofline of a machine with steps placed on it, as SVG (lesson 15).

    render_roofline(machine, [("decode B=1", intensity, flop_per_s), ...], title=...)

Both axes are logarithmic: arithmetic intensity (FLOP/byte) across, FLOP/s up. The two ceilings
are drawn in ink: the sloped memory roof (bandwidth x intensity) and the flat compute roof (the
matmul peak), meeting at the ridge (marked). Each point has its own colour and a legend entry
under the plot, so that no label overlaps the data. Elements for tests: ``ceiling``
(``data-name``), ``point`` (``data-name``, ``data-x``, ``data-y``), ``legend-entry``.
"""
from __future__ import annotations

import math

from visualizer.svg import INK, MUTED, caption, colour, el, svg_root, text, to_string

PLOT_X, PLOT_W, PLOT_H = 80, 440, 240


def _fmt(v: float) -> str:
    for scale, unit in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if v >= scale:
            return f"{v / scale:.3g}{unit}"
    return f"{v:.3g}"


def render_roofline(machine, points: list[tuple[str, float, float]], title: str | None = None,
                    flops_label: str = "FLOP/s") -> str:
    """SVG roofline of ``machine`` (its ``peak_flops``, ``bandwidth``, ``ridge``, ``name``) with
    ``points`` as (label, intensity in FLOP/byte, achieved FLOP/s)."""
    if not points:
        raise ValueError("points must hold at least one (label, intensity, flop/s)")
    xs = [x for _, x, _ in points] + [machine.ridge]
    ys = [y for _, _, y in points] + [machine.peak_flops]
    if min(xs) <= 0 or min(ys) <= 0:
        raise ValueError("intensities and FLOP/s must be > 0 on a log-log plot")
    x_lo = 10 ** math.floor(math.log10(min(xs) / 1.5))
    x_hi = 10 ** math.ceil(math.log10(max(xs) * 1.5))
    y_lo = 10 ** math.floor(math.log10(min(min(ys), machine.attainable(x_lo)) / 1.5))
    y_hi = 10 ** math.ceil(math.log10(max(ys) * 1.5))

    def sx(x: float) -> float:
        return PLOT_X + math.log10(x / x_lo) / math.log10(x_hi / x_lo) * PLOT_W

    def sy(y: float) -> float:
        return top + PLOT_H - math.log10(max(y, y_lo) / y_lo) / math.log10(y_hi / y_lo) * PLOT_H

    top = (40 if title else 14) + 14
    legend_y = top + PLOT_H + 46
    entries = 2 + len(points)
    height = legend_y + 16 * entries + 8
    root = svg_root(PLOT_X + PLOT_W + 30, height, "roofline")
    if title:
        caption(root, 10, 20, title)
    el(root, "rect", x=PLOT_X, y=top, width=PLOT_W, height=PLOT_H, fill="none", stroke=MUTED,
       stroke_width=0.6)
    for e in range(round(math.log10(y_lo)), round(math.log10(y_hi)) + 1):
        y = sy(10.0 ** e)
        el(root, "line", x1=PLOT_X, y1=y, x2=PLOT_X + PLOT_W, y2=y, stroke="#eeeeee")
        text(root, PLOT_X - 4, y + 3, _fmt(10.0 ** e), size=9, anchor="end", fill=MUTED,
             class_="tick")
    for e in range(round(math.log10(x_lo)), round(math.log10(x_hi)) + 1):
        x = sx(10.0 ** e)
        el(root, "line", x1=x, y1=top, x2=x, y2=top + PLOT_H, stroke="#eeeeee")
        text(root, x, top + PLOT_H + 12, f"{10.0 ** e:g}", size=9, anchor="middle", fill=MUTED,
             class_="tick")
    text(root, PLOT_X + PLOT_W / 2, top + PLOT_H + 28,
         "arithmetic intensity (FLOP per byte moved), log scale", size=10, anchor="middle")
    text(root, 10, top - 10, f"{flops_label} reached, log scale", size=10)

    # the two ceilings, drawn in ink; the memory roof dashed so the legend tells them apart
    ridge = machine.ridge
    memory = el(root, "g", class_="ceiling", data_name="memory")
    x_start = max(x_lo, y_lo / machine.bandwidth)
    el(memory, "line", x1=sx(x_start), y1=sy(machine.attainable(x_start)), x2=sx(ridge),
       y2=sy(machine.peak_flops), stroke=INK, stroke_width=2, stroke_dasharray="6 3")
    compute = el(root, "g", class_="ceiling", data_name="compute")
    el(compute, "line", x1=sx(ridge), y1=sy(machine.peak_flops), x2=sx(x_hi),
       y2=sy(machine.peak_flops), stroke=INK, stroke_width=2)
    el(root, "line", x1=sx(ridge), y1=sy(machine.peak_flops), x2=sx(ridge), y2=top + PLOT_H,
       stroke=MUTED, stroke_dasharray="2 3", class_="ridge")
    anchor = "end" if sx(ridge) > PLOT_X + PLOT_W / 2 else "start"
    text(root, sx(ridge) + (-4 if anchor == "end" else 4), top + PLOT_H - 6,
         f"ridge {ridge:.3g} FLOP/B", size=9, anchor=anchor, fill=MUTED)

    legend = [(f"memory roof: bandwidth x intensity ({_fmt(machine.bandwidth)}B/s)", INK, "6 3"),
              (f"compute roof: matmul peak ({_fmt(machine.peak_flops)}FLOP/s)", INK, None)]
    for i, (label, x, y) in enumerate(points):
        g = el(root, "g", class_="point", data_name=label, data_x=x, data_y=y)
        el(g, "circle", cx=sx(x), cy=sy(y), r=4.5, fill=colour(i), stroke="white",
           stroke_width=1)
        legend.append((label, colour(i), "dot"))
    for k, (label, paint, style) in enumerate(legend):
        ly = legend_y + 16 * k
        entry = el(root, "g", class_="legend-entry", data_name=label)
        if style == "dot":
            el(entry, "circle", cx=PLOT_X + 12, cy=ly - 4, r=4.5, fill=paint)
        else:
            el(entry, "line", x1=PLOT_X, y1=ly - 4, x2=PLOT_X + 24, y2=ly - 4, stroke=paint,
               stroke_width=2, stroke_dasharray=style)
        text(entry, PLOT_X + 30, ly, label, size=10, fill=INK)
    return to_string(root)
