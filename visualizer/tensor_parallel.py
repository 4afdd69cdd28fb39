"""Lesson 14's picture of one LLaMA layer cut across tensor-parallel ranks: a lane per rank,
each projection as a box naming the heads or MLP columns that rank holds, and the two all-reduce
bars, the only things that cross between lanes.

The numbers are read from the shards themselves. A weight is stored (out_features, in_features),
as ``nn.Linear`` stores it: a column-parallel shard is a range of its rows (outputs), a
row-parallel shard a range of its columns (inputs), as lesson 14's checker says.
"""
from __future__ import annotations

from visualizer.svg import HIGHLIGHT, PALETTE, el, svg_root, text, to_string

COLUMN, ROW, ATTENTION, REDUCE = PALETTE[0], PALETTE[1], PALETTE[2], HIGHLIGHT
LANE, TOP = 78, 46  # a rank's lane height; the title's band


def _box(root, x, y, width, lines, fill) -> None:
    el(root, "rect", x=x, y=y, width=width, height=52, rx=6, fill=fill, fill_opacity=0.35,
       stroke="#333", stroke_width=1)
    for i, line in enumerate(lines):
        text(root, x + width / 2, y + 20 + 15 * i, line, size=11, anchor="middle")


def _arrow(root, x0, x1, y) -> None:
    el(root, "line", x1=x0, y1=y, x2=x1 - 4, y2=y, stroke="#333", stroke_width=1.2)
    el(root, "path", d=f"M{x1} {y} l-7 -4 v8 z", fill="#333")


def tensor_parallel_layer_svg(shards) -> str:
    """SVG of one decoder layer on ``len(shards)`` ranks.

    Args:
        shards: the ``LlamaDecoderLayer`` each rank built (rank order), under
            ``tensor_parallel_state``.
    """
    n = len(shards)
    heads = shards[0].self_attn.num_heads  # query heads per rank
    kv_heads = shards[0].self_attn.num_kv_heads
    cols = shards[0].mlp.down_proj.in_per_rank  # MLP columns per rank
    root = svg_root(1040, TOP + n * LANE + 24, "tp-layer")
    text(root, 10, 20, f"One LLaMA layer on {n} ranks: blue = column-parallel, orange = "
         "row-parallel, red = the only communication", size=13, weight="bold")
    for rank in range(n):
        y = TOP + rank * LANE
        q0, kv0, c0 = rank * heads, rank * kv_heads, rank * cols
        text(root, 10, y + 31, f"rank {rank}", size=12, weight="bold")
        _box(root, 70, y, 95, ["x", "(whole)"], "#dddddd")
        _box(root, 185, y, 165, [f"q_proj: heads {q0}-{q0 + heads - 1}",
                                 f"k,v_proj: kv head {kv0}"], COLUMN)
        _box(root, 370, y, 160, ["attention on the", f"KV blocks of kv head {kv0}"], ATTENTION)
        _box(root, 550, y, 120, ["o_proj: inputs", f"of heads {q0}-{q0 + heads - 1}"], ROW)
        _box(root, 720, y, 120, ["gate,up_proj:", f"outputs {c0}-{c0 + cols - 1}"], COLUMN)
        _box(root, 860, y, 110, ["down_proj:", f"inputs {c0}-{c0 + cols - 1}"], ROW)
        for x0, x1 in [(165, 185), (350, 370), (530, 550), (670, 690), (710, 720), (840, 860)]:
            _arrow(root, x0, x1, y + 26)
    for x in (690, 975):  # the two all-reduces: the partial sums of all ranks are added
        el(root, "rect", x=x, y=TOP - 6, width=18, height=n * LANE - 10, rx=4, fill=REDUCE)
        text(root, x + 9, TOP + n * LANE + 8, "all-reduce", size=11, anchor="middle",
             fill=REDUCE, weight="bold")
    return to_string(root)
