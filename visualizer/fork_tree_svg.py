"""The fork tree drawn as SVG by us (lesson 03): no graphviz needed, always within the output.

Left to right: the prompt, then each sequence's lives, a child right of its parent. Leaves take
one row each and a parent sits level with the middle of its children. A drawing wider than
``MAX_WIDTH`` is scaled down to it (its ``viewBox`` keeps the natural size), so the beam tree is
never cut at the right edge. The legend under it lists only the kinds of node the tree has, in
rows no wider than the tree.

Elements for the tests: ``fork-node`` (``data-key``, ``data-state``: root, live, final, dropped),
``fork-edge`` (``data-parent``, ``data-child``), ``legend-entry`` (``data-kind``).
"""
from __future__ import annotations

from visualizer.fork_tree import (LEGEND, ForkNode, fork_tree_nodes, fork_tree_text,
                                  legend_kinds)
from visualizer.svg import INK, MUTED, el, svg_root, text, text_width, to_string

MAX_WIDTH = 800
FONT, LINE_H, PAD = 10, 13, 6
COL_GAP, ROW_GAP, LEGEND_ROW_H = 28, 10, 16
# state -> (fill, stroke, dash, stroke width)
LOOKS = {
    "root": ("#eeeeee", INK, None, 1),
    "live": ("white", INK, None, 1),
    "final": ("#d9ead3", INK, None, 2.5),
    "dropped": ("white", "#999999", "4 2", 1),
    "name": ("white", "white", None, 0),
}


def node_lines(node: ForkNode) -> list[str]:
    """The node's label in short lines: 'seq 4b', 'from seq 2', 'step 5 · 12 tokens'."""
    if node.seq_id is None:  # "request 0: prompt of 5 tokens, blocks [0, 1]"
        head, _, rest = node.label.partition(": ")
        prompt, _, blocks = rest.partition(", ")
        return [head, prompt, blocks] if blocks else [head, rest]
    name, _, rest = node.label.partition(" (")
    if not rest:
        return [name]
    origin, _, when = rest.rstrip(")").partition(" at ")
    return [name, origin, when.replace(", ", " · ")]


def _kind(node: ForkNode) -> str:
    return "root" if node.seq_id is None else node.state


def render_fork_tree_svg(nodes: list[ForkNode]) -> str:
    """SVG of the tree of ``fork_tree_nodes``, with a legend of the kinds it contains."""
    if not nodes:
        raise ValueError("no fork tree to draw: the request is not in the recording")
    lines = {n.key: node_lines(n) for n in nodes}
    size = {k: (max(text_width(t, FONT) for t in ls) + 2 * PAD, len(ls) * LINE_H + PAD)
            for k, ls in lines.items()}
    depth = {0: 0}
    for n in nodes:  # parents come before their children
        for c in n.children:
            depth[c] = depth[n.key] + 1
    col_w = [0.0] * (max(depth.values()) + 1)
    for k, d in depth.items():
        col_w[d] = max(col_w[d], size[k][0])
    col_x = [10 + sum(col_w[:d]) + COL_GAP * d for d in range(len(col_w))]
    row_h = max(h for _, h in size.values()) + ROW_GAP
    y: dict[int, float] = {}
    next_row = [0]

    def place(key: int) -> None:
        children = nodes[key].children
        for c in children:
            place(c)
        if children:
            y[key] = (y[children[0]] + y[children[-1]]) / 2
        else:
            y[key] = 10 + next_row[0] * row_h
            next_row[0] += 1

    place(0)
    tree_w = col_x[-1] + col_w[-1] + 10
    tree_h = 10 + next_row[0] * row_h

    kinds = legend_kinds(nodes)
    entries = [(kind, meaning) for kind, meaning in LEGEND if kind in kinds]
    # The legend wraps within the tree's width (or its widest entry's, for a tiny tree).
    legend_w = max([tree_w - 20] + [_entry_w(*e) for e in entries])
    legend_rows = _legend_rows(entries, legend_w)
    width = max(tree_w, legend_w + 20)
    height = tree_h + 6 + len(legend_rows) * LEGEND_ROW_H + 6
    root = svg_root(width, height, "fork-tree", data_num_nodes=len(nodes),
                    data_tree_width=tree_w, data_tree_height=tree_h)
    if width > MAX_WIDTH:  # scaled to fit the output; the viewBox keeps the drawing whole
        root.set("width", str(MAX_WIDTH))
        root.set("height", f"{height * MAX_WIDTH / width:.1f}")

    edges = el(root, "g", class_="fork-edges")
    for n in nodes:
        for c in n.children:
            x1 = col_x[depth[n.key]] + size[n.key][0]
            x2 = col_x[depth[c]]
            y1, y2 = y[n.key] + size[n.key][1] / 2, y[c] + size[c][1] / 2
            el(edges, "path", d=f"M{x1:.1f},{y1:.1f} C{x1 + COL_GAP / 2:.1f},{y1:.1f} "
               f"{x2 - COL_GAP / 2:.1f},{y2:.1f} {x2:.1f},{y2:.1f}", fill="none",
               stroke=MUTED, stroke_width=1, class_="fork-edge", data_parent=n.key, data_child=c)
    for n in nodes:
        kind = _kind(n)
        fill, stroke, dash, width = LOOKS[kind]
        x, top = col_x[depth[n.key]], y[n.key]
        g = el(root, "g", class_="fork-node", data_key=n.key, data_state=kind,
               data_seq=n.seq_id)
        el(g, "rect", x=x, y=top, width=size[n.key][0], height=size[n.key][1], rx=3, fill=fill,
           stroke=stroke, stroke_width=width, stroke_dasharray=dash)
        for i, line in enumerate(lines[n.key]):
            text(g, x + PAD, top + PAD / 2 + (i + 1) * LINE_H - 3, line, size=FONT,
                 fill=MUTED if kind == "dropped" else INK,
                 weight="bold" if i == 0 else None)

    legend = el(root, "g", class_="legend")
    ly = tree_h + 6
    for row in legend_rows:
        x = 10
        for kind, meaning in row:
            fill, stroke, dash, width = LOOKS[kind]
            entry = el(legend, "g", class_="legend-entry", data_kind=kind)
            if kind != "name":
                el(entry, "rect", x=x, y=ly + 1, width=16, height=11, fill=fill, stroke=stroke,
                   stroke_width=width, stroke_dasharray=dash, class_="legend-swatch")
            text(entry, x + (0 if kind == "name" else 21), ly + 10, meaning, size=9)
            x += _entry_w(kind, meaning)
        ly += LEGEND_ROW_H
    return to_string(root)


def _entry_w(kind: str, meaning: str) -> float:
    return (0 if kind == "name" else 21) + text_width(meaning, 9) + 14


def _legend_rows(entries, width: float) -> list[list[tuple[str, str]]]:
    rows: list[list[tuple[str, str]]] = [[]]
    used = 0.0
    for entry in entries:
        w = _entry_w(*entry)
        if rows[-1] and used + w > width:
            rows.append([])
            used = 0.0
        rows[-1].append(entry)
        used += w
    return rows if rows[0] else []


def show_fork_tree(steps, request_id: str) -> None:
    """Display the tree of ``request_id`` in a notebook, from a recording's ``steps``: our own
    SVG (no graphviz needed, scaled to the output's width), its legend the kinds of node it has."""
    from IPython.display import SVG, display

    nodes = fork_tree_nodes(steps, request_id)
    if not nodes:
        print(fork_tree_text(nodes))
        return
    display(SVG(render_fork_tree_svg(nodes)))
