"""One dimension pair of a query, turned by rotary embeddings at several positions (lesson 07).

    render_pair_rotation([("p=0", x0, y0), ("p=1", x1, y1), ...], title="pair 0")

Each entry is a 2-D vector (the pair's two values: dimension i on the x axis, dimension
i + head_size/2 on the y axis), drawn as an arrow from the origin with its label past the tip.
Vectors that rotary embedding turned keep their length, so the arrows end on one circle, drawn
dashed.

Elements for tests: ``pair-arrow`` (``data-label``, ``data-x``, ``data-y``), ``pair-label``.
"""
from __future__ import annotations

import math

from visualizer.svg import MUTED, caption, colour, el, svg_root, text, to_string

SIZE = 300  # the plot is a square of this many pixels
MARGIN = 46  # room for the labels around it


def render_pair_rotation(vectors: list[tuple[str, float, float]], title: str | None = None) -> str:
    """SVG: one arrow per (label, x, y), on axes scaled to the longest vector."""
    if not vectors:
        raise ValueError("nothing to draw")
    top = 34 if title else 8
    width, height = SIZE + 2 * MARGIN, top + SIZE + 2 * MARGIN + 14
    root = svg_root(width, height, "pair-rotation")
    if title:
        caption(root, 10, 22, title)
    cx, cy = width / 2, top + MARGIN + SIZE / 2
    longest = max(math.hypot(x, y) for _, x, y in vectors) or 1.0
    scale = (SIZE / 2 - 6) / longest
    el(root, "line", x1=cx - SIZE / 2, y1=cy, x2=cx + SIZE / 2, y2=cy, stroke=MUTED)
    el(root, "line", x1=cx, y1=cy - SIZE / 2, x2=cx, y2=cy + SIZE / 2, stroke=MUTED)
    # The axes are named under the plot, where no arrow or label can reach.
    text(root, 10, height - 10, "x: dimension i    y: dimension i + D/2", fill=MUTED, size=10,
         class_="axis-note")
    el(root, "circle", cx=cx, cy=cy, r=longest * scale, fill="none", stroke=MUTED,
       stroke_dasharray="3 3")
    for i, (label, x, y) in enumerate(vectors):
        px, py = cx + x * scale, cy - y * scale  # SVG's y axis points down
        el(root, "line", x1=cx, y1=cy, x2=px, y2=py, stroke=colour(i), stroke_width=2.5,
           class_="pair-arrow", data_label=label, data_x=x, data_y=y)
        el(root, "circle", cx=px, cy=py, r=3.5, fill=colour(i))
        angle = math.atan2(-(py - cy), px - cx)
        lx = cx + (math.hypot(x, y) * scale + 22) * math.cos(angle)
        ly = cy - (math.hypot(x, y) * scale + 22) * math.sin(angle) + 4
        text(root, lx, ly, label, anchor="middle", fill=colour(i), weight="bold",
             class_="pair-label")
    return to_string(root)
