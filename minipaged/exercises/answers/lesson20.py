"""Lesson 20's reference answer: Qwen3's per-head norms of the queries and keys, then the rotation.

The learner's stub is the lesson's ``qwen3_queries_keys`` cell; this is one way to fill it.
"""
from __future__ import annotations


def qwen3_queries_keys(attn, positions, q, k):
    """Norm each head's query and key over its head_size numbers, then rotate both."""
    T = q.shape[0]
    q = q.view(T, attn.num_heads, attn.head_size)  # (T, H, D): one row per head
    k = k.view(T, attn.num_kv_heads, attn.head_size)  # (T, KVH, D)
    q, k = attn.q_norm(q), attn.k_norm(k)  # before the rotation, as Qwen3 does
    return attn.rotary(positions, q, k)
