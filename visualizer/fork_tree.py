"""The fork tree of one sequence group (parallel sampling, beam search), from an event log.

The root is the request's prompt. ``allocate`` gives it one child per sequence (they share the
prompt's blocks); every ``fork`` (beam search: a beam continues from another beam) adds a child
under the parent's current node. A sequence id can be reused: in beam search a dropped beam's
sequence is freed and forked again from a better beam, so a node is a (sequence, generation),
named ``seq 4``, ``seq 4b``, ``seq 4c``... so that no two nodes have the same name.

``fork_tree_svg.show_fork_tree`` draws it as SVG (no graphviz needed); ``fork_tree_dot``
gives graphviz's source and ``render_fork_tree`` its drawing where ``dot`` is installed;
``fork_tree_text`` is the tree as indented text.
"""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field


@dataclass
class ForkNode:
    key: int
    seq_id: int | None  # None for the root (the prompt)
    label: str
    parent: int | None
    children: list[int] = field(default_factory=list)
    state: str = "live"  # "live" | "final" (the sequence's last version) | "dropped"


def fork_tree_nodes(steps, request_id: str) -> list[ForkNode]:
    """Nodes of the fork tree of ``request_id`` (root first) from a recording's steps."""
    nodes: list[ForkNode] = []
    current: dict[int, int] = {}  # seq id -> its latest node
    lives: dict[int, int] = {}  # seq id -> how many nodes it has had
    freed: set[int] = set()

    def name(seq_id: int) -> str:
        # A reused sequence id gets a suffix, so that every node's name is unique: seq 4, 4b, 4c
        lives[seq_id] = lives.get(seq_id, 0) + 1
        return f"seq {seq_id}" + ("" if lives[seq_id] == 1 else chr(ord("a") + lives[seq_id] - 1))

    def add(seq_id, label, parent):
        node = ForkNode(len(nodes), seq_id, label, parent)
        nodes.append(node)
        if parent is not None:
            nodes[parent].children.append(node.key)
        return node.key

    for step in steps:
        e = step.event
        where = (f"step {step.engine_step}" if step.engine_step is not None
                 else f"event {step.index}")
        if e["op"] == "allocate" and str(e["request_id"]) == str(request_id) and not nodes:
            seq = next(s for s in step.blocks["sequences"] if s["seq_id"] == e["seq_ids"][0])
            root = add(None, f"request {request_id}: prompt of {seq['num_tokens']} tokens, "
                             f"blocks {e['blocks']}", None)
            for seq_id in e["seq_ids"]:
                current[seq_id] = add(seq_id, name(seq_id), root)
        elif e["op"] == "fork" and e["parent"] in current:
            child = e["child"]
            length = next((s["num_tokens"] for s in step.blocks["sequences"]
                           if s["seq_id"] == child), "?")
            parent = nodes[current[e["parent"]]].label.split(" (")[0]
            current[child] = add(child, f"{name(child)} (from {parent} at {where}, "
                                        f"{length} tokens)", current[e["parent"]])
            freed.discard(child)
        elif e["op"] == "free" and e["seq_id"] in current:
            freed.add(e["seq_id"])
    finals = set(current.values())
    for node in nodes[1:]:
        if node.key in finals:
            node.state = "final" if node.seq_id in freed else "live"
        elif not node.children:
            node.state = "dropped"
    return nodes


def fork_tree_text(nodes: list[ForkNode]) -> str:
    """The tree as indented text (used where graphviz is missing)."""
    if not nodes:
        return "(no such request in the recording)"
    lines: list[str] = []

    def walk(key: int, prefix: str, last: bool, depth: int) -> None:
        node = nodes[key]
        mark = "" if node.state in ("live",) or node.seq_id is None else f"  [{node.state}]"
        branch = "" if depth == 0 else ("└── " if last else "├── ")
        lines.append(prefix + branch + node.label + mark)
        child_prefix = prefix if depth == 0 else prefix + ("    " if last else "│   ")
        for i, child in enumerate(node.children):
            walk(child, child_prefix, i == len(node.children) - 1, depth + 1)

    walk(0, "", True, 0)
    return "\n".join(lines)


# What the tree's looks and names mean, drawn under it and printed under its text version: only
# the kinds a tree has (a sampling tree has no dropped beams).
LEGEND = [
    ("root", "the prompt: blocks shared by all"),
    ("live", "seq N: a sequence from its start"),
    ("final", "finished: a sequence's last version"),
    ("dropped", "dropped: a beam that fell behind"),
    ("name", "seq 4b: seq 4's second life"),
]


def legend_kinds(nodes: list[ForkNode]) -> set[str]:
    """The legend's kinds that ``nodes`` contain."""
    kinds = {"root" if n.seq_id is None else n.state for n in nodes}
    if any(not n.label.split(" (")[0][-1].isdigit() for n in nodes[1:]):
        kinds.add("name")  # a reused sequence id: seq 4b
    return kinds


def fork_tree_dot(nodes: list[ForkNode]) -> str:
    """Graphviz source of the tree, at most 8 inches wide, with a legend of the kinds of node it
    contains (nodes only: the tree's edges are its own)."""
    out = ["digraph fork_tree {", '  rankdir=LR; size="8,40";',
           '  node [shape=box, fontname="monospace", fontsize=10];']
    styles = {"final": 'style="bold,filled", fillcolor="#d9ead3"',
              "dropped": 'style=dashed, color="#999999", fontcolor="#999999"',
              "live": ""}
    for node in nodes:
        label = node.label.replace('"', "'")
        style = (styles[node.state] if node.seq_id is not None
                 else 'style=filled, fillcolor="#eeeeee"')
        out.append(f'  n{node.key} [label="{label}"{", " + style if style else ""}];')
    for node in nodes:
        for child in node.children:
            out.append(f"  n{node.key} -> n{child};")
    out += ['  subgraph cluster_legend {', '    label="legend"; fontname="monospace";'
            ' fontsize=8; color="#bbbbbb"; node [fontsize=8];']
    looks = dict(styles, root='style=filled, fillcolor="#eeeeee"', name="shape=plaintext")
    kinds = legend_kinds(nodes)
    for kind, meaning in LEGEND:
        if kind in kinds:
            out.append(f'    legend_{kind} [label="{meaning}", {looks[kind] or "color=black"}];')
    out += ["  }", "}"]
    return "\n".join(out)


def render_fork_tree(nodes: list[ForkNode]) -> str | None:
    """SVG of the tree drawn by ``dot``, or None where ``dot`` is not installed."""
    dot = shutil.which("dot")
    if dot is None:
        return None
    result = subprocess.run([dot, "-Tsvg"], input=fork_tree_dot(nodes), capture_output=True,
                            text=True, check=True, timeout=60)
    return result.stdout
