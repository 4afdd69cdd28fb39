"""One verification of speculative decoding, drawn on the sequence's last blocks (lesson 12).

    render_verification(sequence, spec, block_size, decode=tokenizer.decode)

``sequence`` is the sequence's entry in the block manager's snapshot *after* the step (its token
ids include the emitted tokens) and ``spec`` its entry in ``StepSnapshot.spec`` (``proposed``,
``accepted``, ``emitted``, ``lookahead_slots``, ``blocks_before``, ``blocks_after``). Two rows of
the same blocks:

  before verification: cached tokens, the newest token (computed in this step), and the
                       lookahead slots holding the guesses (their K/V are written in the pass)
  after verification:  the accepted guesses kept in place, the target's own token (correction or
                       bonus) after them, the rejected guesses' slots rolled back, and the blocks
                       that held only rejected guesses given back to the free list

Only the blocks from the one holding the newest token on are drawn (earlier blocks do not
change). Elements for tests: ``block-row`` (``data-row`` "before" / "after"), ``block``
(``data-block``, ``data-freed``), ``slot`` (``data-kind``, ``data-position``, ``data-block``) and
``legend-entry`` (``data-kind``).
"""
from __future__ import annotations

from visualizer.svg import (FREE_FILL, HIGHLIGHT, INK, MUTED, caption, el, shorten, svg_root,
                            text, to_string)

# slot kind -> (legend label, fill, stroke)
KINDS = {
    "cached": ("cached", "#c6d9ec", "#8aa9c8"),
    "newest": ("newest token", "#4e79a7", INK),
    "draft": ("guess (lookahead slot)", "#f9c48f", "#f28e2b"),
    "accepted": ("accepted guess", "#8cc084", "#3d8b37"),
    "target": ("target's token", "#b07aa1", INK),
    "rolled_back": ("rolled back", "white", HIGHLIGHT),
    "empty": ("empty slot", FREE_FILL, "#cccccc"),
}
MAX_WIDTH = 800
SLOT_H = 30
BLOCK_PAD = 4
ROW_GAP = 30


def verification_slots(sequence: dict, spec: dict, block_size: int) -> dict:
    """What each drawn slot holds before and after the verification.

    Returns {"first_block": index of the first drawn block, "before": [(block number, [(kind,
    token id or None), ...])], "after": [...], "freed": block numbers given back}.
    """
    tokens = tokens_of(sequence)
    emitted, proposed = list(spec["emitted"]), list(spec["proposed"])
    accepted = spec["accepted"]
    length = len(tokens) - len(emitted)  # tokens before the step, the newest one included
    first = (length - 1) // block_size
    before_blocks, after_blocks = list(spec["blocks_before"]), list(spec["blocks_after"])

    def before(pos):
        if pos < length - 1:
            return "cached", tokens[pos]
        if pos == length - 1:
            return "newest", tokens[pos]
        if pos < length + len(proposed):
            return "draft", proposed[pos - length]
        return "empty", None

    def after(pos):
        if pos < length:
            return "cached", tokens[pos]
        if pos < length + accepted:
            return "accepted", tokens[pos]
        if pos == length + accepted:
            return "target", tokens[pos]
        if pos < length + len(proposed):
            return "rolled_back", proposed[pos - length]
        return "empty", None

    def rows(blocks, kind_of):
        return [(number, [kind_of(i * block_size + j) for j in range(block_size)])
                for i, number in enumerate(blocks) if i >= first]

    return {"first_block": first, "before": rows(before_blocks, before),
            "after": rows(after_blocks, after),
            "freed": [b for b in before_blocks[len(after_blocks):]]}


def render_verification(sequence: dict, spec: dict, block_size: int, decode=None,
                        title: str | None = None) -> str:
    """SVG of one sequence's verification (see the module docstring).

    Args:
        decode: token id -> text for the labels under the slots (default: the id).
    """
    if not spec.get("blocks_after"):
        raise ValueError("spec: the sequence finished in this step; nothing was rolled back")
    slots = verification_slots(sequence, spec, block_size)
    num_blocks = len(slots["before"])
    slot_w = min(46.0, (MAX_WIDTH - 20 - num_blocks * (2 * BLOCK_PAD + 10)) /
                 (num_blocks * block_size))
    block_w = block_size * slot_w + 2 * BLOCK_PAD
    label_chars = max(int(slot_w / (0.6 * 9)), 1)
    decode = decode or str
    top = 34 if title else 10
    height = top + 2 * ROW_GAP + 2 * (SLOT_H + 34) + 24
    n_acc, n_prop = spec["accepted"], len(spec["proposed"])
    target_pos = len(tokens_of(sequence)) - 1  # the target's token: the last emitted
    pending = target_pos >= len(spec["blocks_after"]) * block_size
    n_back = n_prop - n_acc - (1 if n_acc < n_prop else 0)
    headings = {
        "before": f"before verification: the newest token and {n_prop} guesses in lookahead slots",
        "after": f"after: {n_acc} of {n_prop} accepted, then the target's "
                 + ("bonus token" if n_acc == n_prop else "correction")
                 + (f", {n_back} rolled back" if n_back else "")
                 + (f", block {', '.join(f'#{b}' for b in slots['freed'])} freed"
                    if slots["freed"] else ""),
    }
    legend_w = sum(30 + 0.6 * 9 * len(KINDS[k][0]) for k in LEGEND)
    width = max(20 + num_blocks * (block_w + 10) + (120 if pending else 0), 20 + legend_w,
                20 + 0.6 * 11 * max(len(h) for h in headings.values()))
    root = svg_root(width, height, "verification", data_block_size=block_size,
                    data_accepted=spec["accepted"], data_proposed=len(spec["proposed"]))
    if title:
        caption(root, 10, 20, title)
    y = top
    for row in ("before", "after"):
        group = el(root, "g", class_="block-row", data_row=row)
        text(group, 10, y + 14, headings[row], size=11, weight="bold")
        if slots["first_block"]:
            text(group, 10, y + 28, f"(blocks 0..{slots['first_block'] - 1} of the table: "
                 f"cached tokens, unchanged)", size=9, fill=MUTED)
        by = y + 48
        drawn = list(slots[row])
        if row == "after":  # the freed blocks stay in place, drawn as given back
            drawn += [(b, [("empty", None)] * block_size) for b in slots["freed"]]
        for i, (number, kinds) in enumerate(drawn):
            freed = row == "after" and number in slots["freed"]
            bx = 10 + i * (block_w + 10)
            block = el(group, "g", class_="block", data_block=number, data_freed=freed)
            el(block, "rect", x=bx, y=by - 14, width=block_w, height=SLOT_H + 20,
               fill="none", stroke=HIGHLIGHT if freed else MUTED, stroke_width=1.5 if freed else 1,
               stroke_dasharray="5 3" if freed else None, class_="block-outline")
            text(block, bx + 3, by - 3, f"#{number}" + ("  freed: back to the free list" if freed
                                                       else ""), size=9, weight="bold",
                 fill=HIGHLIGHT if freed else INK)
            for j, (kind, token) in enumerate(kinds):
                sx = bx + BLOCK_PAD + j * slot_w
                _, fill, stroke = KINDS[kind]
                position = (slots["first_block"] + i) * block_size + j
                el(block, "rect", x=sx, y=by, width=slot_w - 2, height=SLOT_H - 6,
                   fill=FREE_FILL if freed else fill, stroke=stroke,
                   stroke_width=2 if kind in ("newest", "target") else 1, class_="slot",
                   data_kind="freed" if freed else kind, data_position=position,
                   data_block=number)
                if kind == "rolled_back":
                    el(block, "line", x1=sx + 2, y1=by + 2, x2=sx + slot_w - 4,
                       y2=by + SLOT_H - 8, stroke=HIGHLIGHT, stroke_width=1.2)
                if token is not None and not freed:
                    label = shorten(decode(token).replace("\n", "⏎"), label_chars)
                    text(block, sx + (slot_w - 2) / 2, by + SLOT_H + 7, label, size=9,
                         anchor="middle", fill=MUTED if kind == "rolled_back" else INK,
                         class_="token-label")
        if row == "after" and pending:  # the bonus token's block comes with the next step
            bx = 10 + len(drawn) * (block_w + 10)
            el(group, "rect", x=bx, y=by, width=slot_w - 2, height=SLOT_H - 6,
               fill=KINDS["target"][1], stroke=INK, stroke_width=2, class_="slot pending",
               data_kind="target", data_position=target_pos)
            text(group, bx + (slot_w - 2) / 2, by + SLOT_H + 7,
                 shorten(decode(tokens_of(sequence)[-1]), label_chars), size=9, anchor="middle",
                 class_="token-label")
            text(group, bx, by - 3, "its block: next step", size=9, fill=MUTED)
        y += ROW_GAP + SLOT_H + 34
    _legend(root, 10, height - 16)
    return to_string(root)


LEGEND = ("cached", "newest", "draft", "accepted", "target", "rolled_back")


def tokens_of(sequence: dict) -> list[int]:
    return [t for lb in sequence["logical_blocks"] for t in lb["token_ids"]]


def _legend(root, x, y):
    group = el(root, "g", class_="legend")
    for kind in LEGEND:
        label, fill, stroke = KINDS[kind]
        entry = el(group, "g", class_="legend-entry", data_kind=kind)
        el(entry, "rect", x=x, y=y - 9, width=14, height=10, fill=fill, stroke=stroke)
        text(entry, x + 18, y, label, size=9)
        x += 18 + 0.6 * 9 * len(label) + 12
    return x


__all__ = ["render_verification", "verification_slots"]
