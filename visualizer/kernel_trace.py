"""The real kernel's recorded loops, drawn (lessons 05 and 06).

Input: one CUDA block's record from ``minipaged.lab.kernel_trace.run_traced`` (a dict of
lists and tensors; any sequence of numbers works) and, for the key loads, the per-lane load
lists of one warp. Four drawings:

    render_warp_visits(t)           warps x KV blocks: which warp visits which block, in order
    render_logits(t, block_size)    phase 2: one bar per token (scale * q.k), the maximum marked
    render_phase4_sums(t, out_row)  phase 4: each warp's row sums, added up into the output
    render_key_loads({name: loads}) phase 2: the bytes each load instruction of a warp reads
    render_key_readers({name: who})  kv heads x tokens: which CUDA blocks loaded each key (a
                                    per-head kernel against the grouped one, lesson 18)

Elements for tests: ``visit`` (data-warp, data-block, data-physical, data-order), ``logit``
(data-token, data-warp, data-value), ``max-marker`` (data-token, data-value), ``warp-sum``
(data-row, data-warp, data-value), ``row-total`` and ``output`` (data-row, data-value), ``load``
(data-variant, data-instruction, data-lane, data-offset, data-bytes), ``reader`` (data-kernel,
data-kv-head, data-token, data-cuda-block).
"""
from __future__ import annotations

from visualizer.svg import (FREE_FILL, HIGHLIGHT, INK, MUTED, caption, colour, el, svg_root,
                            text, text_width, to_string)

NUM_WARPS = 4


def _fmt(v: float) -> str:
    return f"{float(v):.3g}"


def _exact(v: float) -> str:  # for data attributes, which tests read
    return f"{float(v):.7g}"


def _legend(root, x: float, y: float, labels: list[str]) -> None:
    for i, label in enumerate(labels):
        el(root, "rect", x=x, y=y - 9, width=10, height=10, fill=colour(i), class_="swatch")
        text(root, x + 14, y, label, size=10)
        x += 14 + text_width(label, 10) + 14


def render_warp_visits(t: dict, title: str | None = None) -> str:
    """Warps (rows) x the sequence's KV blocks (columns): a filled cell is a block the warp's
    phase-2 loop visited, labelled with the physical block and the visit's order (#1, #2, ...)."""
    visits, physical = t["visits"], t["physical"]
    blocks = max((b for v in visits for b in v), default=-1) + 1
    if blocks == 0:
        raise ValueError("the trace has no visits to draw")
    cell, left, top = 46, 62, 58 if title else 38
    width = left + blocks * cell + 10
    footer = f"warp w visits blocks w, w+{NUM_WARPS}, w+{2 * NUM_WARPS}, ... ({blocks} blocks)"
    width = max(width, 20 + text_width(footer, 10))
    height = top + NUM_WARPS * cell + 30
    root = svg_root(width, height, "warp-visits", data_blocks=blocks)
    if title:
        caption(root, 10, 18, title)
    for b in range(blocks):
        text(root, left + b * cell + cell / 2, top - 8, f"blk {b}", size=9, anchor="middle",
             fill=MUTED)
    for w in range(NUM_WARPS):
        y = top + w * cell
        text(root, left - 6, y + cell / 2 + 4, f"warp {w}", size=10, anchor="end")
        for b in range(blocks):
            el(root, "rect", x=left + b * cell + 1, y=y + 1, width=cell - 2, height=cell - 2,
               fill=FREE_FILL)
        for order, (b, p) in enumerate(zip(visits[w], physical[w]), start=1):
            g = el(root, "g", class_="visit", data_warp=w, data_block=b, data_physical=p,
                   data_order=order)
            x = left + b * cell
            el(g, "rect", x=x + 1, y=y + 1, width=cell - 2, height=cell - 2, fill=colour(w),
               opacity=0.6)
            text(g, x + cell / 2, y + 18, f"p{p}", size=10, anchor="middle")
            text(g, x + cell / 2, y + 34, f"#{order}", size=9, anchor="middle", fill=INK)
    text(root, 10, height - 10, footer, size=10, fill=MUTED)
    return to_string(root)


def render_logits(t: dict, block_size: int, title: str | None = None) -> str:
    """Phase 2's logits, one bar per token of the CUDA block (up from the zero line when
    positive), coloured by the warp that computed it; the maximum (phase 3's first reduction)
    is outlined and labelled."""
    logits = [float(v) for v in t["logits"]]
    if not logits:
        raise ValueError("the trace has no logits to draw")
    first = int(t.get("first_token", 0))
    n = len(logits)
    bar = max(3.0, min(12.0, 900 / n))
    left, top, plot_h = 50, 76 if title else 56, 160
    width = left + n * bar + 20
    hi = max(max(abs(v) for v in logits), 1e-9)
    best = max(range(n), key=lambda i: logits[i])
    label = f"max = {_fmt(logits[best])} at token {first + best}"
    width = max(width, 20 + text_width(label, 11) + 20, 20 + text_width(title or "", 13),
                left + 4 * 90)
    height = top + plot_h + 46
    root = svg_root(width, height, "logits", data_tokens=n, data_max=_exact(logits[best]))
    if title:
        caption(root, 10, 18, title)
    _legend(root, left, top - 26, [f"warp {w}" for w in range(NUM_WARPS)])
    zero = top + plot_h / 2
    el(root, "line", x1=left, y1=zero, x2=left + n * bar, y2=zero, stroke=MUTED, stroke_width=0.6)
    text(root, left - 4, zero + 4, "0", size=9, anchor="end", fill=MUTED)
    text(root, left - 4, top + 8, _fmt(hi), size=9, anchor="end", fill=MUTED)
    for i, v in enumerate(logits):
        token = first + i
        warp = (token // block_size - first // block_size) % NUM_WARPS
        h = abs(v) / hi * (plot_h / 2)
        g = el(root, "g", class_="logit", data_token=token, data_warp=warp, data_value=_exact(v))
        el(g, "rect", x=left + i * bar, y=zero - h if v >= 0 else zero, width=max(bar - 1, 1),
           height=max(h, 0.5), fill=colour(warp))
    for b in range(0, n, block_size):  # block boundaries
        x = left + b * bar
        el(root, "line", x1=x, y1=top, x2=x, y2=top + plot_h, stroke="#dddddd", stroke_width=0.6)
    x = left + best * bar + bar / 2
    h = abs(logits[best]) / hi * (plot_h / 2)
    marker = el(root, "g", class_="max-marker", data_token=first + best,
                data_value=_exact(logits[best]))
    el(marker, "rect", x=left + best * bar - 1, y=zero - h - 1, width=bar + 1, height=h + 2,
       fill="none", stroke=HIGHLIGHT, stroke_width=1.5)
    anchor = "start" if x + text_width(label, 11) < width - 10 else "end"
    text(marker, x, top + plot_h + 20, label, size=11, anchor=anchor, fill=HIGHLIGHT)
    el(marker, "line", x1=x, y1=zero, x2=x, y2=top + plot_h + 8, stroke=HIGHLIGHT,
       stroke_width=0.8, stroke_dasharray="3,2")
    text(root, 10, height - 8, f"tokens {first}..{first + n - 1}; grey lines: KV block boundaries",
         size=10, fill=MUTED)
    return to_string(root)


def render_phase4_sums(t: dict, out_row, rows=range(8), title: str | None = None) -> str:
    """Phase 4's cross-warp add for some rows (head dimensions): each warp's row sum, their
    total, and the kernel's output element next to it."""
    rows = list(rows)
    sums = t["warp_sums"]
    col, left, top = 78, 60, 58 if title else 38
    headers = [f"warp {w}" for w in range(NUM_WARPS)] + ["sum", "output"]
    width = left + len(headers) * col + 10
    width = max(width, 20 + text_width(title or "", 13))
    footer = "sum = warp 0 + warp 1 + warp 2 + warp 3 (after the barrier, thread d adds row d)"
    width = max(width, 20 + text_width(footer, 10))
    height = top + len(rows) * 20 + 30
    root = svg_root(width, height, "phase4-sums", data_rows=len(rows))
    if title:
        caption(root, 10, 18, title)
    for c, h in enumerate(headers):
        text(root, left + c * col + col / 2, top - 8, h, size=10, anchor="middle", weight="bold")
    for r, row in enumerate(rows):
        y = top + r * 20
        text(root, left - 6, y + 14, f"d {row}", size=10, anchor="end")
        values = [float(sums[w][row]) for w in range(NUM_WARPS)]
        total = sum(values)
        for w, v in enumerate(values):
            g = el(root, "g", class_="warp-sum", data_row=row, data_warp=w, data_value=_exact(v))
            el(g, "rect", x=left + w * col + 1, y=y + 1, width=col - 2, height=18,
               fill=colour(w), opacity=0.35)
            text(g, left + w * col + col / 2, y + 14, _fmt(v), size=10, anchor="middle")
        for c, cls, v in ((NUM_WARPS, "row-total", total), (NUM_WARPS + 1, "output", out_row[row])):
            g = el(root, "g", class_=cls, data_row=row, data_value=_exact(v))
            el(g, "rect", x=left + c * col + 1, y=y + 1, width=col - 2, height=18, fill=FREE_FILL)
            text(g, left + c * col + col / 2, y + 14, _fmt(v), size=10, anchor="middle",
                 weight="bold")
    text(root, 10, height - 8, footer, size=10, fill=MUTED)
    return to_string(root)


def render_key_loads(loads_by_variant: dict, group_size: int, title: str | None = None,
                     window: tuple[int, int] | None = None) -> str:
    """The bytes of one KV block's keys (x axis) that each load instruction of one warp reads
    (one strip per instruction), for each variant; a lane's bytes are coloured by its place in
    its thread group of ``group_size`` lanes. ``loads_by_variant[name]`` is the warp's per-lane
    lists of (byte offset, bytes) in one KV block (``kernel_trace.visit_loads``); offsets are
    drawn from the smallest one.

    Args:
        window: (first byte, end byte), counted from the smallest offset: draw only that part of
            the block, magnified, and only the instructions that read in it (a 4-byte load is a
            fraction of a pixel across a whole block: zoomed to a cache line it is a mark).
    """
    if not loads_by_variant or group_size < 1:
        raise ValueError("no loads to draw, or group_size < 1")
    starts = [a for lanes in loads_by_variant.values() for loads in lanes for a, _ in loads]
    ends = [a + s for lanes in loads_by_variant.values() for loads in lanes for a, s in loads]
    base, span = min(starts), max(ends) - min(starts)
    lo, hi = window if window is not None else (0, span)
    if not 0 <= lo < hi:
        raise ValueError(f"window must be (first, end) bytes with 0 <= first < end, got {window}")
    left, plot_w = 110, 800
    strip = 9 if window is None else 14
    scale = plot_w / (hi - lo)

    def inside(a: int, s: int) -> bool:
        return a - base < hi and a - base + s > lo

    shown = {name: [i for i in range(max(len(loads) for loads in lanes))
                    if any(i < len(loads) and inside(*loads[i]) for loads in lanes)]
             for name, lanes in loads_by_variant.items()}
    top = 78 if title else 58
    height = top + sum(28 + len(rows) * strip + 8 for rows in shown.values()) + 24
    width = left + plot_w + 20
    root = svg_root(width, height, "key-loads", data_bytes=span, data_group_size=group_size)
    if title:
        caption(root, 10, 18, title)
    _legend(root, 10, top - 26, [f"lane {j} of its group" for j in range(group_size)])
    y = top
    for name, lanes in loads_by_variant.items():
        instructions = max(len(loads) for loads in lanes)
        size = max(s for loads in lanes for _, s in loads)
        text(root, 10, y + 12, f"{name}: {instructions} load instructions of {size} B per lane"
             + ("" if window is None else f" ({len(shown[name])} read in this window)"),
             size=11, weight="bold")
        y += 22
        for i in shown[name]:
            text(root, left - 6, y + strip - 1, f"load {i}", size=8, anchor="end", fill=MUTED)
            for lane, loads in enumerate(lanes):
                if i >= len(loads) or not inside(*loads[i]):
                    continue
                a, s = loads[i]
                x0, x1 = max(a - base, lo), min(a - base + s, hi)  # clipped to the window
                el(root, "rect", x=left + (x0 - lo) * scale, y=y,
                   width=max((x1 - x0) * scale - 0.4, 0.6), height=strip - 1,
                   fill=colour(lane % group_size), class_="load", data_variant=name,
                   data_instruction=i, data_lane=lane, data_offset=a - base, data_bytes=s)
            y += strip
        y += 14
    what = (f"the {span} bytes of one KV block's keys" if window is None
            else f"bytes {lo}-{hi} of the {span} bytes of one KV block's keys, magnified")
    text(root, 10, height - 8, f"x: {what}, in memory order", size=10, fill=MUTED)
    return to_string(root)


def render_key_readers(readers_by_kernel: dict, num_kv_heads: int, num_tokens: int,
                       title: str | None = None) -> str:
    """One grid per kernel: a row per kv head, a column per token of one sequence; each cell is
    cut into one stripe per CUDA block that loaded some of that key, in the CUDA block's colour
    (its blockIdx.x: the query head in V1 and V2, the kv head in the grouped kernel).
    ``readers_by_kernel[name][(kv_head, token)]`` lists those CUDA blocks' blockIdx.x (built from
    ``minipaged.lab.kernel_trace.key_readers`` and the block table)."""
    if not readers_by_kernel or num_kv_heads < 1 or num_tokens < 1:
        raise ValueError("nothing to draw")
    left, cell, row_h = 90, min(16, 760 / num_tokens), 26
    top = 40 if title else 20
    panel_h = 24 + num_kv_heads * row_h + 14
    height = top + len(readers_by_kernel) * panel_h + 20
    footer = "x: the sequence's tokens; colour: the CUDA block (blockIdx.x) that loaded the key"
    width = max(left + num_tokens * cell + 20, 20 + text_width(footer, 10))
    root = svg_root(width, height, "key-readers")
    if title:
        caption(root, 10, 18, title)
    y = top
    for name, readers in readers_by_kernel.items():
        most = max((len(r) for r in readers.values()), default=0)
        text(root, 10, y + 12, f"{name}: each key loaded by {most} CUDA block"
             + ("s" if most != 1 else ""), size=11, weight="bold")
        y += 22
        for kv_head in range(num_kv_heads):
            text(root, left - 6, y + row_h / 2 + 4, f"kv head {kv_head}", size=9, anchor="end",
                 fill=MUTED)
            for token in range(num_tokens):
                loaders = sorted(readers.get((kv_head, token), []))
                if not loaders:
                    el(root, "rect", x=left + token * cell, y=y, width=cell - 1,
                       height=row_h - 2, fill=FREE_FILL)
                stripe = (row_h - 2) / max(len(loaders), 1)
                for i, block in enumerate(loaders):
                    el(root, "rect", x=left + token * cell, y=y + i * stripe, width=cell - 1,
                       height=stripe, fill=colour(block), class_="reader", data_kernel=name,
                       data_kv_head=kv_head, data_token=token, data_cuda_block=block)
            y += row_h
        y += 14
    text(root, 10, height - 6, footer, size=10, fill=MUTED)
    return to_string(root)
