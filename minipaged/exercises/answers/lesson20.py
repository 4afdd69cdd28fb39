"""Lesson 20's reference answers: Qwen3's per-head norms of the queries and keys, then the
rotation; the entries of a sliding group's block table that go back to the pool.

The learner's stubs are the lesson's cells of the same names; these are one way to fill them.
"""
from __future__ import annotations


def qwen3_queries_keys(attn, positions, q, k):
    """Norm each head's query and key over its head_size numbers, then rotate both."""
    T = q.shape[0]
    q = q.view(T, attn.num_heads, attn.head_size)  # (T, H, D): one row per head
    k = k.view(T, attn.num_kv_heads, attn.head_size)  # (T, KVH, D)
    q, k = attn.q_norm(q), attn.k_norm(k)  # before the rotation, as Qwen3 does
    return attn.rotary(positions, q, k)


def blocks_out_of_window(num_tokens, window, block_size, block_table):
    """The indices of the table's entries whose blocks no token from the newest on reads."""
    first_read = num_tokens - window  # the newest token's window starts at this position
    freed = []
    for i, number in enumerate(block_table[:-1]):  # never the last entry
        if (i + 1) * block_size <= first_read and number != -1:
            freed.append(i)
    return freed
