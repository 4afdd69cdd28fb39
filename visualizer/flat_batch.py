"""One engine step's flat batch, drawn token by token (lessons 07, 08 and 09).

    render_flat_batch(prepare_inputs(...), block_size, names={seq_id: "req 0"})

(``prepare_inputs`` of ``minipaged/worker/model_runner.py`` on the scheduler's outputs, or
``prepare_inputs_for_groups`` of ``minipaged/lab/batch_inputs.py`` on groups made by hand.)

A column per token of the step: which sequence it belongs to, prefill or decode, its token id,
its position, and its slot (``slot_mapping``) as physical block and offset. Under the table, the
physical blocks the step writes, with the slots written this step filled in the sequence's
colour. Everything comes from the ``PreparedInputs`` fields ``input_ids``, ``positions``,
``meta.slot_mapping``, ``chunks`` and ``rows``.

Elements for tests: ``batch-token`` (``data-index``, ``data-seq``, ``data-kind``,
``data-position``, ``data-slot``) and ``written-block`` (``data-block``, ``data-slots``).
"""
from __future__ import annotations

from visualizer.svg import FREE_FILL, INK, MUTED, caption, colour, el, svg_root, text, to_string

COL_W, ROW_H, HEAD_W = 34, 17, 92
ROWS = ("sequence", "kind", "token id", "position", "slot", "block.offset")
KIND_LABELS = {"prefill": "pre", "chunk": "chunk", "decode": "dec"}


def flat_batch_tokens(prepared, block_size: int) -> list[dict]:
    """One dict per token of the batch: seq id, kind, token id, position, slot, block, offset.

    ``kind`` is "prefill" for a prompt's tokens, "chunk" for a piece of a prompt that continues
    in a later step (chunked prefill: nothing is sampled from it), "decode" for a decode token.
    """
    ids = prepared.input_ids.tolist()
    positions = prepared.positions.tolist()
    slots = prepared.meta.slot_mapping.tolist()
    spans = [(c.seq_ids[0], "prefill" if c.sample else "chunk", c.num_tokens)
             for c in prepared.chunks]
    spans += [(row.seq_ids[0], "decode", 1) for row in prepared.rows if not row.is_prompt]
    tokens, i = [], 0
    for seq_id, kind, length in spans:
        for _ in range(length):
            tokens.append({"seq": seq_id, "kind": kind, "token": ids[i],
                           "position": positions[i], "slot": slots[i],
                           "block": slots[i] // block_size, "offset": slots[i] % block_size})
            i += 1
    return tokens


def render_flat_batch(prepared, block_size: int, title: str | None = None,
                      names: dict[int, str] | None = None) -> str:
    """SVG of the step's flat batch and the blocks it writes."""
    tokens = flat_batch_tokens(prepared, block_size)
    names = names or {}
    top = 40 if title else 14
    blocks = sorted({t["block"] for t in tokens})
    per_row = max(1, (len(tokens) * COL_W) // (block_size * 12 + 70))
    per_row = min(per_row, 8)
    block_w = block_size * 12 + 8
    blocks_y = top + ROW_H * len(ROWS) + 34
    block_rows = -(-len(blocks) // per_row)
    width = max(HEAD_W + COL_W * len(tokens) + 10, 10 + per_row * (block_w + 62), 460)
    height = blocks_y + block_rows * 34 + 10
    root = svg_root(width, height, "flat-batch", data_num_tokens=len(tokens))
    if title:
        caption(root, 10, 18, title)
    for r, label in enumerate(ROWS):
        text(root, 10, top + r * ROW_H + 12, label, size=10, weight="bold")
    for i, t in enumerate(tokens):
        x = HEAD_W + i * COL_W
        c = colour(t["seq"])
        g = el(root, "g", class_="batch-token", data_index=i, data_seq=t["seq"],
               data_kind=t["kind"], data_position=t["position"], data_slot=t["slot"])
        el(g, "rect", x=x, y=top, width=COL_W - 2, height=ROW_H * len(ROWS), fill=c,
           opacity=0.15 if t["kind"] == "decode" else 0.35)
        values = (names.get(t["seq"], f"s{t['seq']}"), KIND_LABELS[t["kind"]],
                  t["token"], t["position"], t["slot"], f"{t['block']}.{t['offset']}")
        for r, value in enumerate(values):
            text(g, x + (COL_W - 2) / 2, top + r * ROW_H + 12, value, size=8, anchor="middle")
    text(root, 10, blocks_y - 10, "blocks written this step (filled: slots written now)", size=10,
         weight="bold")
    for k, number in enumerate(blocks):
        x = 10 + (k % per_row) * (block_w + 62)
        y = blocks_y + (k // per_row) * 34
        written = {t["offset"]: t["seq"] for t in tokens if t["block"] == number}
        g = el(root, "g", class_="written-block", data_block=number,
               data_slots=",".join(map(str, sorted(written))))
        text(g, x, y + 12, f"#{number}", size=10, weight="bold")
        for slot in range(block_size):
            seq = written.get(slot)
            el(g, "rect", x=x + 48 + slot * 12, y=y + 2, width=11, height=14,
               fill=colour(seq) if seq is not None else FREE_FILL,
               stroke=INK if seq is not None else MUTED, stroke_width=0.4)
    return to_string(root)
