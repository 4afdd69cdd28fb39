"""Where the KV cache goes: a max-length contiguous reservation against paged blocks (lesson 01).

Draws ``minipaged.lab.kv_memory.WasteReport`` objects (the numbers are computed there, not here):
for each scheme a bar split into used / reserved / internal / external fragmentation (time
averages over the whole trace), and a memory map of the pool at one step of the run.

Elements for tests: ``waste-bar`` (``data-scheme``, ``data-waste``), ``segment`` (``data-kind``,
``data-fraction``), ``memory-map`` (``data-scheme``, ``data-step``) and ``map-run``
(``data-kind``, ``data-slots``).
"""
from __future__ import annotations

from visualizer.svg import INK, MUTED, caption, el, svg_root, text, to_string

KIND_COLOURS = {"used": "#59a14f", "reserved": "#edc948", "internal": "#f28e2b",
                "external": "#e15759", "free": "#eeeeee"}
KIND_LABELS = {"used": "used (token K/V)", "reserved": "reserved for later tokens",
               "internal": "internal fragmentation", "external": "external fragmentation",
               "free": "free (nobody waiting)"}
BAR_X, BAR_W = 150, 620


def render_memory_waste(*reports, title: str | None = None) -> str:
    """SVG comparing ``WasteReport`` objects (typically contiguous, then paged)."""
    top = 40 if title else 16
    section_h = 96
    height = top + section_h * len(reports) + 40
    root = svg_root(BAR_X + BAR_W + 20, height, "memory-waste")
    if title:
        caption(root, 10, 20, title)
    y = top
    for report in reports:
        bar = el(root, "g", class_="waste-bar", data_scheme=report.scheme,
                 data_waste=f"{report.waste_fraction:.6f}")
        text(bar, 10, y + 16, report.scheme, weight="bold")
        text(bar, 10, y + 31, f"waste {100 * report.waste_fraction:.1f}%"
             + (f" (block {report.block_size})" if report.block_size else ""), size=10,
             fill="#e15759" if report.waste_fraction > 0.2 else INK)
        x = BAR_X
        for kind in ("used", "reserved", "internal", "external"):
            frac = report.fraction(kind)
            seg = el(bar, "g", class_="segment", data_kind=kind, data_fraction=f"{frac:.6f}",
                     data_slot_steps=report.slot_steps[kind])
            el(seg, "rect", x=x, y=y + 4, width=BAR_W * frac, height=26,
               fill=KIND_COLOURS[kind])
            if frac > 0.06:
                text(seg, x + BAR_W * frac / 2, y + 21, f"{100 * frac:.0f}%", size=10,
                     anchor="middle")
            x += BAR_W * frac
        _memory_map(root, report, y + 42)
        y += section_h
    # legend
    x = 10
    for kind, label in KIND_LABELS.items():
        el(root, "rect", x=x, y=height - 26, width=10, height=10, fill=KIND_COLOURS[kind],
           stroke=MUTED, stroke_width=0.5)
        text(root, x + 14, height - 17, label, size=9)
        x += 22 + 6.2 * len(label)
    return to_string(root)


def _memory_map(root, report, y):
    group = el(root, "g", class_="memory-map", data_scheme=report.scheme,
               data_step=report.layout_step, data_capacity=report.capacity)
    text(group, 10, y + 12, f"pool at step {report.layout_step}", size=9, fill=MUTED)
    total = sum(n for _, n in report.layout) or 1
    x = BAR_X
    for kind, n in report.layout:
        w = BAR_W * n / total
        el(group, "rect", x=x, y=y, width=max(w, 0.2), height=18, fill=KIND_COLOURS[kind],
           class_="map-run", data_kind=kind, data_slots=n)
        x += w
    el(group, "rect", x=BAR_X, y=y, width=BAR_W, height=18, fill="none", stroke=MUTED,
       stroke_width=0.5)
    text(group, BAR_X, y + 32, f"{report.capacity} slots · {report.max_running} requests "
         f"at most running at once"
         + (f" · counted by {report.counted_by}" if report.counted_by else ""), size=9,
         fill=MUTED)
