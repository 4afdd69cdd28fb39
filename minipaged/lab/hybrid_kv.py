"""What KV cache groups save (lesson 20, ``benchmarks/hybrid_kv.py``): a request's KV bytes and
the requests a pool holds, with every layer keeping every token, and with one block table per
group of layers (``core/hybrid_block_manager.py``), computed from a model's shape by the block
manager's own rules.

A full group holds a block for every ``block_size`` tokens; a sliding group of window W holds
the blocks of its newest W tokens, at most ``ceil((W - 1) / block_size) + 1``
(``core/sliding_window.py``). Every block of a group is ``2 x its layers x kv heads x head
size x bytes per element x block_size`` bytes.
"""
from __future__ import annotations

import math

from minipaged.model_shape import kv_bytes_per_token, kv_groups


def group_blocks(window: int | None, num_tokens: int, block_size: int) -> int:
    """Blocks one group holds for a sequence of ``num_tokens`` tokens (while it decodes).

    Args:
        window: the group's sliding window, None for full attention.
        num_tokens: the sequence's length.
        block_size: tokens per block.
    """
    blocks = math.ceil(num_tokens / block_size)
    if window is None:
        return blocks
    return min(blocks, math.ceil((window - 1) / block_size) + 1)


def kv_bytes_per_request(windows: tuple, num_kv_heads: int, head_size: int,
                         element_size: int, num_tokens: int, block_size: int = 16,
                         hybrid: bool = True) -> int:
    """KV bytes one request of ``num_tokens`` tokens holds.

    Args:
        windows: each layer's window, None for full attention (``ModelShape.windows``).
        num_kv_heads, head_size: the model's kv heads and their width.
        element_size: bytes of one element (2 for bfloat16).
        num_tokens: the request's length.
        block_size: tokens per block.
        hybrid: one block table per KV cache group; False: every layer keeps every token.
    """
    if not hybrid:
        return (math.ceil(num_tokens / block_size) * block_size
                * kv_bytes_per_token(len(windows), num_kv_heads, head_size, element_size))
    return sum(group_blocks(g.window, num_tokens, block_size) * block_size
               * kv_bytes_per_token(len(g.layers), num_kv_heads, head_size, element_size)
               for g in kv_groups(windows))


def requests_held(pool_bytes: int, windows: tuple, num_kv_heads: int, head_size: int,
                  element_size: int, num_tokens: int, block_size: int = 16) -> dict[str, int]:
    """How many requests of ``num_tokens`` tokens a pool of ``pool_bytes`` holds at once.

    "every block": every layer keeps every token. "hybrid, held": the pool over what a
    hybrid request holds. "hybrid, admitted one by one": as the engine admits them, each
    admission asking room for its whole prompt in every group (what the every-block engine
    asks) while the requests before it hold their hybrid share.
    """
    args = (windows, num_kv_heads, head_size, element_size, num_tokens, block_size)
    every = kv_bytes_per_request(*args, hybrid=False)
    held = kv_bytes_per_request(*args, hybrid=True)
    return {"every block": pool_bytes // every, "hybrid, held": pool_bytes // held,
            "hybrid, admitted one by one": (0 if pool_bytes < every
                                            else 1 + (pool_bytes - every) // held)}


def gemma3_270m_windows() -> tuple:
    """Gemma 3 270M's layers as its config names them: 18, every sixth full attention, the
    others sliding with a 512-token window (1 kv head of 256, bfloat16)."""
    return tuple(None if layer % 6 == 5 else 512 for layer in range(18))


def group_rows(snapshot: dict, seq_id: int, groups=None) -> dict:
    """A ``HybridBlockManager.snapshot`` as ``visualizer.render_block_tables`` draws it, one
    row per KV cache group: the row numbered g is the sequence's block table in group g
    (-1: a block that left the window), and a pool block is owned by its group's row.

    Args:
        snapshot: the manager's snapshot (with ``kv_groups``).
        seq_id: the sequence whose tables are drawn.
        groups: the groups' indices to draw (0: the full group); None: all.
    """
    seq = next(s for s in snapshot["sequences"] if s["seq_id"] == seq_id)
    tables = [seq["block_table"]] + [g["block_tables"][seq_id] for g in snapshot["kv_groups"]]
    windows = [None] + [g["window"] for g in snapshot["kv_groups"]]
    rows = [{**seq, "seq_id": g, "block_table": tables[g],
             "request_id": "full group" if windows[g] is None else f"window {windows[g]}"}
            for g in (range(len(tables)) if groups is None else groups)]
    blocks = [{**b, "owners": [b["kv_group"]] * len(b["owners"])} if b["owners"] else b
              for b in snapshot["gpu_blocks"]]
    return {**snapshot, "sequences": rows, "gpu_blocks": blocks}
