"""Reference answer of lesson 07's component: the paged attention layer's forward.

The learner's stub is ``minipaged.exercises.lesson07.MyAttention``; this is one way to fill it.
"""
from __future__ import annotations

import torch

from minipaged.kernels import kv_quant, ops
from minipaged.models.attention import PagedAttention
from minipaged.models.input_metadata import InputMetadata


class Attention(PagedAttention):
    """``PagedAttention`` with its forward written out: cache write, then three paths, each
    within the layer's sliding window (None: the whole context)."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: tuple[torch.Tensor, ...] | None,
                meta: InputMetadata) -> torch.Tensor:
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size)  # (T, H, D)
        k = key.view(num_tokens, self.num_kv_heads, self.head_size)  # (T, KVH, D)
        v = value.view(num_tokens, self.num_kv_heads, self.head_size)  # (T, KVH, D)

        # First the cache: the chunk and decode paths below read this step's own keys and
        # values from it (a decode token attends to itself too).
        key_cache = value_cache = scales = None
        if kv_cache is not None:
            key_cache, value_cache = kv_cache[0], kv_cache[1]
            scales = tuple(kv_cache[2:]) or None  # an 8-bit cache's scales (lesson 18)
            ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, scales)

        # The batch is [fresh prompts | chunks over a cached context | one token per decode].
        prompt_end = meta.num_fresh_prompt_tokens
        chunk_end = prompt_end + meta.num_chunk_tokens
        out = torch.empty_like(q)  # (T, H, D)

        if prompt_end > 0:
            # Fresh prompts see only each other's keys, causally, prompt by prompt; they need
            # no cache read. With an 8-bit cache they use the values as stored (rounded).
            k_prompt, v_prompt = k[:prompt_end], v[:prompt_end]  # (P, KVH, D)
            if scales is not None:
                k_prompt = kv_quant.round_trip(k_prompt, key_cache.dtype)
                v_prompt = kv_quant.round_trip(v_prompt, value_cache.dtype)
            out[:prompt_end] = ops.prefill_attention(q[:prompt_end], k_prompt, v_prompt,
                                                     meta.prompt_lens, self.scale,
                                                     window=self.sliding_window)
        if chunk_end > prompt_end:
            # Chunks: their context (cached earlier, and their own keys just written) comes
            # from the cache through each chunk's block table.
            out[prompt_end:chunk_end] = ops.paged_prefill_attention(
                q[prompt_end:chunk_end], key_cache, value_cache, meta.chunk_block_tables,
                meta.chunk_query_start_loc, meta.chunk_context_lens, self.scale, scales,
                window=self.sliding_window)
        if num_tokens > chunk_end:
            # Decodes: one query per sequence over its whole context (lesson 05's kernel).
            out[chunk_end:] = ops.paged_attention(
                q[chunk_end:], key_cache, value_cache, meta.block_tables, meta.context_lens,
                self.scale, meta.max_context_len, scales, window=self.sliding_window)
        return out.view(num_tokens, self.num_heads * self.head_size)
