"""The block-table picture of the vLLM paper, drawn from ``BlockSpaceManager.snapshot()``.

    logical blocks (per sequence)  |  block table  |  physical pool (ref counts) + free list

Every sequence has its own colour. A physical block holds its number, its ref count and a strip
of slots; a block held by more than one sequence (ref count > 1) is striped with its owners'
colours and outlined with a dashed line. The newest token of each sequence is outlined in red.

Elements carry ``class`` and ``data-*`` attributes so tests can read the drawing back:
``physical-block`` (``data-block``, ``data-device``, ``data-ref``, ``data-shared``,
``data-owners``, ``data-filled``), ``free-block``, ``shared-block``, ``logical-block``
(``data-seq``, ``data-index``, ``data-filled``), ``table-entry`` (``data-seq``, ``data-index``,
``data-block``), ``free-list-entry`` (``data-block``, ``data-position``) and ``newest-token``.

With prefix caching (lesson 11) a block the cache can hand out by hash is ``cached-block``
(``data-hash``), outlined in green and marked "cached"; one that nobody holds any more is also
``evictable-block``, marked "evictable": it counts as free but keeps its KV until evicted.

A step's changes (``marks``: new, copied, freed, preempted, found by ``legend.step_marks``) are
outlined as ``step-mark`` (``data-mark``) and the block's group gets ``data-mark``. Every look
comes from ``visualizer/legend.py``, and its ``legend`` (``legend-entry`` with ``data-kind`` and
``data-present``) is drawn under every picture.

The drawing stays within ``MAX_WIDTH`` (800 px, narrower than a JupyterLab output area): the pool
wraps into rows of ``BLOCKS_PER_ROW`` blocks, and the free list shows what fits, then "+N more".
"""
from __future__ import annotations

from visualizer.legend import LOOKS, STEP_KINDS, draw_legend, legend_height, step_kind
from visualizer.svg import (FREE_FILL, HIGHLIGHT, INK, MUTED, caption, colour, el, shorten,
                            svg_root, text, to_string)

ROW_H = 18  # one logical block per row
BLOCK_W, BLOCK_H, BLOCK_GAP = 70, 38, 6  # one physical block: '#1455' and 'ref 12' side by side
X_LOGICAL, X_TABLE, X_POOL = 10, 226, 390
# The whole drawing fits a JupyterLab output area (about 900 px): the pool wraps into rows.
MAX_WIDTH = 800
POOL_W = MAX_WIDTH - X_POOL - 10
BLOCKS_PER_ROW = POOL_W // (BLOCK_W + BLOCK_GAP)
FREE_ENTRY_W, FREE_MORE_W = 30, 62  # one free-list entry; the "+1440 more" after the last
LABEL_CHARS = int((X_POOL - X_LOGICAL - 10) / (0.6 * 11))  # a sequence's label, left of the pool


def _slot_width(block_size: int) -> float:
    return min(14.0, 160.0 / block_size)


def _pool_positions(numbers: list[int], x0: float, y0: float) -> dict[int, tuple[float, float]]:
    pos = {}
    for i, n in enumerate(numbers):
        pos[n] = (x0 + (i % BLOCKS_PER_ROW) * (BLOCK_W + BLOCK_GAP),
                  y0 + (i // BLOCKS_PER_ROW) * (BLOCK_H + BLOCK_GAP))
    return pos


def _rows_height(count: int) -> float:
    rows = -(-count // BLOCKS_PER_ROW)
    return rows * (BLOCK_H + BLOCK_GAP)


def _blocks_to_draw(pool: list[dict], limit: int, free_order: list[int],
                    keep=frozenset()) -> tuple[list[dict], int]:
    """All held blocks and those in ``keep``, then the free ones that will be handed out next,
    up to ``limit``; returns (blocks, elided)."""
    if len(pool) <= limit:
        return pool, 0
    # Held blocks, and the evictable ones (free, but still findable by hash): the text about a
    # prefix cache talks about them, and they stand last in the free list. Marked blocks (freed
    # this step) are drawn wherever they stand.
    held = [b for b in pool if b["ref_count"] > 0 or b.get("cached") or b["block_number"] in keep]
    by_number = {b["block_number"]: b for b in pool}
    held_numbers = {b["block_number"] for b in held}
    free = [by_number[n] for n in free_order if n not in held_numbers][:max(0, limit - len(held))]
    chosen = sorted(held + free, key=lambda b: b["block_number"])
    return chosen, len(pool) - len(chosen)


def render_block_tables(snapshot: dict, title: str | None = None,
                        highlight_blocks=(), highlight_seq: int | None = None,
                        max_pool_blocks: int = 128, max_free_list: int = 16,
                        highlight_colour: str = HIGHLIGHT, highlight_mark: str | None = None,
                        marks: dict | None = None) -> str:
    """SVG of the block tables in ``snapshot`` (the dict of ``BlockSpaceManager.snapshot()``).

    Args:
        title: a line above the drawing (e.g. the step's caption).
        highlight_blocks: GPU block numbers the current event changed, drawn with the
            legend's look of ``highlight_mark`` ("new" unless given).
        highlight_seq: the sequence the current event is about; its label is bold.
        highlight_mark: which change ``highlight_blocks`` had: "new", "copied" (or "copy"),
            "freed", "preempted"; another word is a ValueError.
        highlight_colour: kept for older callers and not used: every mark's colour is the
            legend's (``visualizer/legend.py``), the same in every lesson.
        marks: the step's changes by kind, ``{"copied": [blocks], ...}`` (``legend.step_marks``),
            besides ``highlight_blocks``.
        max_pool_blocks: a larger pool is drawn as its held blocks plus the free ones that
            will be handed out next.
        max_free_list: free-list entries drawn before "+N more" (at most what fits the width).
    """
    block_size = snapshot["block_size"]
    seqs = sorted(snapshot["sequences"], key=lambda s: s["seq_id"])
    cw = _slot_width(block_size)
    mark_of = _marks_by_block(highlight_blocks, highlight_mark, marks)

    # What each physical block holds: filled slots (the fullest owner) and the newest tokens.
    filled: dict[tuple[str, int], int] = {}
    newest: dict[tuple[str, int], set[int]] = {}
    for s in seqs:
        logical = s["logical_blocks"]
        for i, number in enumerate(s["block_table"]):
            if i < len(logical):
                key = (s["device"], number)
                filled[key] = max(filled.get(key, 0), logical[i]["num_filled"])
        last = len(logical) - 1
        if 0 <= last < len(s["block_table"]) and logical[last]["num_filled"]:
            newest.setdefault((s["device"], s["block_table"][last]), set()).add(
                logical[last]["num_filled"] - 1)

    # ---- layout: left column height ----------------------------------------------------------
    top = 44 if title else 26
    left_h = sum(ROW_H * (1 + len(s["logical_blocks"])) + 8 for s in seqs) or ROW_H
    gpu_draw, gpu_elided = _blocks_to_draw(snapshot["gpu_blocks"], max_pool_blocks,
                                           snapshot["free_gpu_blocks"], set(mark_of))
    # The swap space matters only where it holds something: its held blocks and one row more.
    cpu_held = sum(b["ref_count"] > 0 for b in snapshot["cpu_blocks"])
    cpu_draw, cpu_elided = _blocks_to_draw(snapshot["cpu_blocks"],
                                           min(max_pool_blocks, cpu_held + BLOCKS_PER_ROW),
                                           snapshot["free_cpu_blocks"])
    gpu_y = top + 16
    gpu_pos = _pool_positions([b["block_number"] for b in gpu_draw], X_POOL, gpu_y)
    free_y = gpu_y + _rows_height(len(gpu_draw)) + (14 if gpu_elided else 0) + 14
    cpu_y = free_y + 44
    cpu_pos = _pool_positions([b["block_number"] for b in cpu_draw], X_POOL, cpu_y + 16)
    right_h = (cpu_y + 16 + _rows_height(len(cpu_draw)) + (14 if cpu_elided else 0)
               if cpu_draw else free_y + 30)
    max_free_list = min(max_free_list, (POOL_W - FREE_MORE_W) // FREE_ENTRY_W)
    width = X_POOL + max(BLOCKS_PER_ROW * (BLOCK_W + BLOCK_GAP),
                         max_free_list * FREE_ENTRY_W + FREE_MORE_W) + 10
    if title:  # a long caption widens the drawing rather than leaving it
        width = max(width, 20 + 0.6 * 13 * len(title))
    height = max(top + left_h + 10, right_h + 10)
    legend_y = height
    height += legend_height(width - 2 * X_LOGICAL)

    free_gpu = snapshot["free_gpu_blocks"]
    root = svg_root(width, height, "block-tables",
                    data_block_size=block_size, data_num_seqs=len(seqs),
                    data_num_gpu_blocks=len(snapshot["gpu_blocks"]),
                    data_num_free_gpu_blocks=len(free_gpu),
                    data_num_cpu_blocks=len(snapshot["cpu_blocks"]),
                    data_num_free_cpu_blocks=len(snapshot["free_cpu_blocks"]))
    if title:
        caption(root, 10, 18, title)
    text(root, X_LOGICAL, top - 6, "logical blocks", weight="bold")
    text(root, X_TABLE, top - 6, "block table", weight="bold")
    text(root, X_POOL, gpu_y - 4, f"GPU pool: {len(snapshot['gpu_blocks'])} blocks of "
         f"{block_size} slots", weight="bold")

    # ---- mapping lines (under everything else) -----------------------------------------------
    lines = el(root, "g", class_="mappings")
    # ---- sequences: logical blocks and block table -------------------------------------------
    y = top
    for s in seqs:
        c = colour(s["seq_id"])
        group = el(root, "g", class_="sequence", data_seq=s["seq_id"],
                   data_request=s["request_id"], data_status=s["status"],
                   data_device=s["device"], data_num_tokens=s["num_tokens"])
        label = _seq_label(s)
        # (a yellow or light blue label on white is drawn darker, in its own hue: an edge drawn
        # round the letters read as a line struck through them at the page's size)
        text(group, X_LOGICAL, y + 12, label, fill=label_colour(c),
             weight="bold" if s["seq_id"] == highlight_seq else None)
        y += ROW_H
        pos = cpu_pos if s["device"] == "cpu" else gpu_pos
        last = len(s["logical_blocks"]) - 1
        for i, lb in enumerate(s["logical_blocks"]):
            row = el(group, "g", class_="logical-block", data_seq=s["seq_id"], data_index=i,
                     data_filled=lb["num_filled"])
            text(row, X_LOGICAL, y + 12, f"L{i}", size=10, fill=MUTED)
            for slot in range(block_size):
                is_filled = slot < lb["num_filled"]
                is_newest = i == last and slot == lb["num_filled"] - 1
                el(row, "rect", x=X_LOGICAL + 26 + slot * cw, y=y + 2, width=cw, height=13,
                   fill=c if is_filled else "white", stroke=HIGHLIGHT if is_newest else "#cccccc",
                   stroke_width=2 if is_newest else 0.5,
                   class_="slot newest-token" if is_newest else "slot")
            if i < len(s["block_table"]):
                number = s["block_table"][i]
                prefix = "cpu " if s["device"] == "cpu" else ""
                entry = el(group, "g", class_="table-entry", data_seq=s["seq_id"], data_index=i,
                           data_block=number, data_device=s["device"])
                if number < 0:  # a dropped entry: the block left a sliding window, no KV kept
                    text(entry, X_TABLE, y + 12, f"{i} → #-1 dropped", size=10, fill=MUTED)
                else:
                    text(entry, X_TABLE, y + 12, f"{i} → {prefix}#{number}  "
                         f"{lb['num_filled']}/{block_size}", size=10)
                if number in pos:
                    bx, by = pos[number]
                    el(lines, "line", x1=X_TABLE + 128, y1=y + 8, x2=bx, y2=by + BLOCK_H / 2,
                       stroke=c, stroke_width=1, opacity=0.45, class_="mapping",
                       data_seq=s["seq_id"], data_block=number)
            else:
                # The newest token opened this logical block; its physical block comes with the
                # next append_slot: the next step's schedule() for a running sequence, the step
                # that swaps it back in for a swapped one.
                el(group, "text", f"{i} → {_PENDING.get(s['status'], '(next step)')}", x=X_TABLE,
                   y=y + 12, font_size=10, fill=MUTED, class_="table-entry pending",
                   data_seq=s["seq_id"], data_index=i)
            y += ROW_H
        y += 8

    # ---- the pools ---------------------------------------------------------------------------
    _draw_pool(root, gpu_draw, gpu_pos, "gpu", block_size, filled, newest, mark_of)
    if gpu_elided:
        text(root, X_POOL, gpu_y + _rows_height(len(gpu_draw)) + 8,
             f"(+{gpu_elided} more free blocks not drawn)", size=10, fill=MUTED,
             class_="pool-elided", data_count=gpu_elided)
    _draw_free_list(root, free_gpu, X_POOL, free_y, max_free_list)
    if cpu_draw:
        text(root, X_POOL, cpu_y + 12, f"CPU pool (swap space): {len(snapshot['cpu_blocks'])} "
             f"blocks, {len(snapshot['free_cpu_blocks'])} free", weight="bold")
        _draw_pool(root, cpu_draw, cpu_pos, "cpu", block_size, filled, newest, {})
        if cpu_elided:
            text(root, X_POOL, cpu_y + 16 + _rows_height(len(cpu_draw)) + 8,
                 f"(+{cpu_elided} more free blocks not drawn)", size=10, fill=MUTED,
                 class_="pool-elided", data_device="cpu", data_count=cpu_elided)
    draw_legend(root, X_LOGICAL, legend_y, width - 2 * X_LOGICAL,
                _kinds_drawn(gpu_draw + cpu_draw, mark_of, newest))
    return to_string(root)


def _marks_by_block(highlight_blocks, highlight_mark, marks) -> dict[int, str]:
    """GPU block -> the one step kind it is drawn with (``STEP_KINDS``' precedence)."""
    wanted: dict[str, set[int]] = {kind: set() for kind in STEP_KINDS}
    for kind, blocks in (marks or {}).items():
        if kind not in wanted:
            raise ValueError(f"marks has kind {kind!r}; the legend's step kinds are "
                             f"{list(STEP_KINDS)}")
        wanted[kind] |= set(blocks)
    wanted[step_kind(highlight_mark)] |= set(highlight_blocks)
    mark_of: dict[int, str] = {}
    for kind in reversed(STEP_KINDS):  # the first kind wins
        mark_of.update(dict.fromkeys(wanted[kind], kind))
    return mark_of


def _kinds_drawn(blocks: list[dict], mark_of: dict[int, str], newest) -> set[str]:
    """The legend's kinds that the drawing shows."""
    drawn = {b["block_number"] for b in blocks}
    kinds = {kind for number, kind in mark_of.items() if number in drawn}
    for b in blocks:
        ref = b["ref_count"]
        kinds.add("free" if ref == 0 and not b.get("cached") else
                  "shared" if ref > 1 else "held")
        if b.get("cached"):
            kinds.add("evictable" if ref == 0 else "cached")
    if newest:
        kinds.add("newest")
    return kinds


# Where a logical block's physical block will come from, when it has none yet.
_PENDING = {"SWAPPED": "(when swapped in)", "WAITING": "(when admitted)"}


def _brightness(hex_colour: str) -> float:
    """0 (black) to 1 (white), weighted as the eye sees."""
    r, g, b = (int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def label_colour(hex_colour: str) -> str:
    """The colour as text on white: as it is, or, where too light to read (brightness above
    0.6), the same hue darkened to brightness 0.5."""
    bright = _brightness(hex_colour)
    if bright <= 0.6:
        return hex_colour
    k = 0.5 / bright
    return "#" + "".join(f"{round(int(hex_colour[i:i + 2], 16) * k):02x}" for i in (1, 3, 5))


def _seq_label(s: dict) -> str:
    """'seq 3 · req 1 · running · 40 tok', with a long request id (a server's
    'chatcmpl-...') shortened so that the label ends before the pool."""
    rest = f" · {s['status'].lower()} · {s['num_tokens']} tok" + (
        " · on CPU" if s["device"] == "cpu" else "")
    head = f"seq {s['seq_id']} · req "
    return head + shorten(s["request_id"], max(LABEL_CHARS - len(head) - len(rest), 5)) + rest


def _draw_pool(root, blocks, pos, device, block_size, filled, newest, mark_of):
    pool = el(root, "g", class_=f"pool {device}-pool", data_device=device)
    for b in blocks:
        number, ref, owners = b["block_number"], b["ref_count"], b["owners"]
        x, y = pos[number]
        shared = ref > 1
        classes = ["physical-block", "free-block" if ref == 0 else "used-block"]
        if shared:
            classes.append("shared-block")
        cached = b.get("cached", False)
        if cached:
            classes += ["cached-block"] + (["evictable-block"] if ref == 0 else [])
        mark = mark_of.get(number)
        n_filled = filled.get((device, number), 0) if ref else 0
        g = el(pool, "g", class_=" ".join(classes), data_block=number, data_device=device,
               data_ref=ref, data_shared=shared, data_owners=",".join(map(str, owners)),
               data_filled=n_filled, data_mark=mark)
        if ref == 0:
            el(g, "rect", x=x, y=y, width=BLOCK_W, height=BLOCK_H, fill=LOOKS["free"].fill,
               stroke=LOOKS["free"].stroke, stroke_width=1, class_="block-body")
        else:
            # One band per owner: a shared block shows every sequence that reads it.
            band = BLOCK_W / max(len(owners), 1)
            for k, owner in enumerate(owners or [None]):
                el(g, "rect", x=x + k * band, y=y, width=band, height=BLOCK_H,
                   fill=colour(owner) if owner is not None else "#cccccc", opacity=0.3)
            look = LOOKS["shared"]
            el(g, "rect", x=x, y=y, width=BLOCK_W, height=BLOCK_H, fill="none",
               stroke=look.stroke if shared else INK, stroke_width=look.width if shared else 1,
               stroke_dasharray=look.dash if shared else None, class_="block-outline")
        text(g, x + 3, y + 11, f"#{number}", size=10, weight="bold",
             fill=INK if ref else MUTED, class_="block-number")
        text(g, x + BLOCK_W - 3, y + 11, f"ref {ref}", size=9, anchor="end",
             fill=INK if ref else MUTED, weight="bold" if shared else None, class_="ref-count")
        if shared:
            text(g, x + 3, y + 23, LOOKS["shared"].word, size=8, fill=LOOKS["shared"].stroke,
                 class_="shared-mark")
        if cached:  # lesson 11: findable by hash; when ref 0 it is evictable (counts as free)
            g.set("data-hash", str(b["block_hash"]))
            look = LOOKS["evictable" if ref == 0 else "cached"]
            el(g, "rect", x=x - 1, y=y - 1, width=BLOCK_W + 2, height=BLOCK_H + 2, fill="none",
               stroke=look.stroke, stroke_width=look.width, stroke_dasharray=look.dash,
               class_="cached-outline")
            text(g, x + BLOCK_W - 3, y + 23, look.word, size=8, anchor="end", fill=look.stroke,
                 class_="cached-mark")
        # The slot strip: filled slots dark, the newest token of a sequence outlined in red.
        sw = (BLOCK_W - 6) / block_size
        fill_colour = colour(owners[0]) if len(owners) == 1 else INK
        newest_look = LOOKS["newest"]
        for slot in range(block_size):
            is_newest = slot in newest.get((device, number), ()) if ref else False
            el(g, "rect", x=x + 3 + slot * sw, y=y + BLOCK_H - 11, width=sw, height=8,
               fill=fill_colour if slot < n_filled else "white",
               stroke=newest_look.stroke if is_newest else "#cccccc",
               stroke_width=newest_look.width if is_newest else 0.3,
               class_="slot newest-token" if is_newest else "slot")
        if mark is not None:  # this step's change: outside the block, in the legend's look
            look = LOOKS[mark]
            el(g, "rect", x=x - 2, y=y - 2, width=BLOCK_W + 4, height=BLOCK_H + 4, fill="none",
               stroke=look.stroke, stroke_width=look.width, stroke_dasharray=look.dash,
               class_="event-block step-mark", data_mark=mark, data_block=number)
            right = len(LOOKS["evictable" if ref == 0 else "cached"].word) if cached else 0
            if not shared and len(look.word) + right <= 12:  # the words fit side by side
                text(g, x + 3, y + 23, look.word, size=8, fill=look.stroke,
                     class_="event-mark step-mark-word", data_mark=mark)


def _draw_free_list(root, free: list[int], x, y, max_entries):
    group = el(root, "g", class_="free-list", data_device="gpu", data_count=len(free))
    text(group, x, y + 2, f"free list ({len(free)} blocks, next out first):", size=10,
         weight="bold")
    for i, number in enumerate(free[:max_entries]):
        bx = x + i * FREE_ENTRY_W
        el(group, "rect", x=bx, y=y + 8, width=26, height=16, fill=FREE_FILL, stroke=MUTED,
           class_="free-list-entry", data_block=number, data_position=i)
        text(group, bx + 13, y + 20, number, size=9, anchor="middle")
        if i:
            el(group, "line", x1=bx - 4, y1=y + 16, x2=bx, y2=y + 16, stroke=MUTED)
    if len(free) > max_entries:
        text(group, x + max_entries * FREE_ENTRY_W + 2, y + 20, f"+{len(free) - max_entries} more",
             size=9, fill=MUTED, class_="free-list-more", data_count=len(free) - max_entries)
    if not free:
        text(group, x, y + 20, "(empty: the next new block means preemption)", size=9,
             fill=HIGHLIGHT)


def block_tables_of(step_snapshot) -> dict[int, list[int]]:
    """{seq_id: its block table} of an engine's ``StepSnapshot`` (lesson 16's live view compares
    the learner's and ``LLM()``'s at each step)."""
    return {s["seq_id"]: s["block_table"] for s in step_snapshot.block_manager["sequences"]}
