"""The paged attention layer shared by all models (lesson 07).

It replaces the usual "concatenate past keys" attention: new keys and values are written into
their cache slots, prompts attend to themselves, chunks after a cached context and decode tokens
read that context through the block table. A layer with a sliding window (Mistral, Gemma 3's
sliding layers) lets each token see only the ``sliding_window`` newest tokens. A layer's cache is ``(key_cache, value_cache)``, or
with an 8-bit cache (lesson 18) ``(key_cache, value_cache, key_scales, value_scales)``.
"""
from __future__ import annotations

import torch
from torch import nn

from minipaged.kernels import kv_quant, ops
from minipaged.models.input_metadata import InputMetadata


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: int | None = None, sliding_window: int | None = None) -> None:
        super().__init__()
        self.sliding_window = sliding_window  # None: the whole context
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads
        assert self.num_heads % self.num_kv_heads == 0

    def forward(
        self,
        query: torch.Tensor,  # (T, num_heads * head_size)
        key: torch.Tensor,  # (T, num_kv_heads * head_size)
        value: torch.Tensor,  # (T, num_kv_heads * head_size)
        kv_cache: tuple[torch.Tensor, ...] | None,
        meta: InputMetadata,
    ) -> torch.Tensor:  # (T, num_heads * head_size)
        T = query.shape[0]
        q = query.view(T, self.num_heads, self.head_size)  # (T, H, D)
        k = key.view(T, self.num_kv_heads, self.head_size)  # (T, KVH, D)
        v = value.view(T, self.num_kv_heads, self.head_size)  # (T, KVH, D)
        kv_scales = None
        if kv_cache is not None:
            key_cache, value_cache, *scales = kv_cache
            kv_scales = tuple(scales) or None  # (key_scales, value_scales) of an 8-bit cache
            ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, kv_scales)
        out = torch.empty_like(q)  # (T, H, D)
        P = meta.num_fresh_prompt_tokens  # prompts attending only to themselves
        C = P + meta.num_chunk_tokens  # then chunks attending to their cached context too
        if P:
            k_p, v_p = k[:P], v[:P]  # (P, KVH, D)
            if kv_scales is not None:
                # NOTE: prompts attend to their keys and values as the 8-bit cache holds them,
                # so a prompt computes the same whether it runs whole, in chunks, after a
                # cached prefix or again after a preemption.
                k_p = kv_quant.round_trip(k_p, key_cache.dtype)
                v_p = kv_quant.round_trip(v_p, value_cache.dtype)
            out[:P] = ops.prefill_attention(q[:P], k_p, v_p, meta.prompt_lens, self.scale,
                                            window=self.sliding_window)
        if C > P:
            out[P:C] = ops.paged_prefill_attention(
                q[P:C], key_cache, value_cache, meta.chunk_block_tables,
                meta.chunk_query_start_loc, meta.chunk_context_lens, self.scale, kv_scales,
                window=self.sliding_window)
        if T > C:
            assert kv_cache is not None, "decode tokens need a KV cache"
            out[C:] = ops.paged_attention(q[C:], key_cache, value_cache, meta.block_tables,
                                          meta.context_lens, self.scale, meta.max_context_len,
                                          kv_scales, window=self.sliding_window)
        return out.view(T, self.num_heads * self.head_size)
