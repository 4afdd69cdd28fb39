"""Probability distributions over a few tokens, as bar panels side by side (lesson 12).

    render_distributions([("target p", p), ("draft q", q), ...], token_labels=["a", "b", ...],
                         overlay={"output (measured)": p})

One panel per distribution, all on the same y scale, so that bars can be compared across panels
(rejection sampling: p, q, min(p, q), the measured output). ``stack`` puts a second part on top
of a panel's bars, in its own colour (min(p, q) with the rejected mass times the residual on
it: together they are p). ``overlay`` draws a black tick over a panel's bars at another
distribution's values (the measured histogram against the p it should match). Elements for
tests: ``panel`` (``data-name``), ``bar`` (``data-name``, ``data-token``, ``data-value``),
``stacked-bar`` (the same, ``data-name`` the stacked part's) and ``overlay-tick``
(``data-name``, ``data-token``, ``data-value``).
"""
from __future__ import annotations

from visualizer.svg import INK, MUTED, caption, colour, el, shorten, svg_root, text, to_string

PANEL_H = 130  # the bars' height at the largest value
PANEL_GAP = 22
BAR_GAP = 3
MAX_WIDTH = 800


def _values(dist) -> list[float]:
    """A list of floats from a list, a NumPy array or a 1-D tensor."""
    if hasattr(dist, "tolist"):
        dist = dist.tolist()
    return [float(v) for v in dist]


def render_distributions(panels, token_labels=None, title: str | None = None,
                         overlay: dict | None = None, colours: dict | None = None,
                         overlay_note: str | None = None, stack: dict | None = None) -> str:
    """SVG of ``panels`` (a list of (name, distribution over the same tokens)).

    Args:
        token_labels: the text under each bar (default: the token's index).
        overlay: panel name -> a distribution drawn as black ticks over that panel's bars.
        colours: panel name -> bar colour (default: the palette in panel order).
        overlay_note: a line under the panels saying what the ticks are.
        stack: panel name -> (part name, a distribution) drawn on top of that panel's bars, in
            ``colours[part name]`` (default: the palette colour after the panels').
    """
    panels = [(name, _values(dist)) for name, dist in panels]
    if not panels:
        raise ValueError("panels: nothing to draw")
    num_tokens = len(panels[0][1])
    if any(len(v) != num_tokens for _, v in panels):
        raise ValueError("panels: every distribution must cover the same tokens")
    labels = [str(t) for t in (token_labels or range(num_tokens))]
    overlay = {name: _values(d) for name, d in (overlay or {}).items()}
    stack = {name: (part, _values(d)) for name, (part, d) in (stack or {}).items()}
    if set(stack) - {name for name, _ in panels}:
        raise ValueError(f"stack: no panel named {sorted(set(stack) - dict(panels).keys())}")
    if any(len(v) != num_tokens for _, v in stack.values()):
        raise ValueError("stack: every distribution must cover the same tokens")
    colours = colours or {}
    heights = [max(v) for _, v in panels] + [max(v) for v in overlay.values()]
    heights += [max(a + b for a, b in zip(dict(panels)[name], part[1]))
                for name, part in stack.items()]
    top_value = max(heights + [1e-9])

    panel_w = min(200, (MAX_WIDTH - 20 - PANEL_GAP * (len(panels) - 1)) / len(panels))
    bar_w = (panel_w - BAR_GAP * (num_tokens + 1)) / num_tokens
    label_chars = max(int(bar_w / (0.6 * 9)), 1)
    top = 34 if title else 10
    base = top + 34 + PANEL_H  # the bars' baseline (room for the top bar's value)
    width = 20 + len(panels) * panel_w + PANEL_GAP * (len(panels) - 1)
    height = base + 36
    root = svg_root(width, height, "distributions", data_tokens=num_tokens)
    if title:
        caption(root, 10, 20, title)
    for i, (name, values) in enumerate(panels):
        x0 = 10 + i * (panel_w + PANEL_GAP)
        g = el(root, "g", class_="panel", data_name=name)
        text(g, x0 + panel_w / 2, top + 12, shorten(name, int(panel_w / (0.6 * 11))), size=11,
             anchor="middle", weight="bold")
        el(g, "line", x1=x0, y1=base, x2=x0 + panel_w, y2=base, stroke=MUTED, stroke_width=1)
        fill = colours.get(name, colour(i))
        for t, v in enumerate(values):
            x = x0 + BAR_GAP + t * (bar_w + BAR_GAP)
            h = PANEL_H * v / top_value
            el(g, "rect", x=x, y=base - h, width=bar_w, height=h, fill=fill, class_="bar",
               data_name=name, data_token=t, data_value=f"{v:.4f}")
            total = v
            if name in stack:
                part, on_top = stack[name][0], stack[name][1][t]
                h_top = PANEL_H * on_top / top_value
                el(g, "rect", x=x, y=base - h - h_top, width=bar_w, height=h_top,
                   fill=colours.get(part, colour(len(panels))), class_="stacked-bar",
                   data_name=part, data_token=t, data_value=f"{on_top:.4f}")
                total, h = v + on_top, h + h_top
            if total > 0:
                text(g, x + bar_w / 2, base - h - 3, f"{total:.2f}".lstrip("0") or "0", size=8,
                     anchor="middle", fill=MUTED)
            text(g, x + bar_w / 2, base + 12, shorten(labels[t], label_chars), size=9,
                 anchor="middle")
            if name in overlay:
                ov = overlay[name][t]
                y = base - PANEL_H * ov / top_value
                el(g, "line", x1=x - 1, y1=y, x2=x + bar_w + 1, y2=y, stroke=INK,
                   stroke_width=2.5, class_="overlay-tick", data_name=name, data_token=t,
                   data_value=f"{ov:.4f}")
    if overlay_note:
        text(root, 10, height - 8, overlay_note, size=10, fill=MUTED, class_="overlay-note")
    return to_string(root)


__all__ = ["render_distributions"]
