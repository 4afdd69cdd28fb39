"""Lesson 07 as a learner answers it: the three paths' outputs concatenated, a reshape helper."""

# %%
def split_heads(x, num_heads, head_size):
    """(T, num_heads * head_size) -> (T, num_heads, head_size)"""
    return x.reshape(x.shape[0], num_heads, head_size)


# %%
class MyAttention(PagedAttention):
    def forward(self, query, key, value, kv_cache, meta):
        T = query.shape[0]
        q = split_heads(query, self.num_heads, self.head_size)
        k = split_heads(key, self.num_kv_heads, self.head_size)
        v = split_heads(value, self.num_kv_heads, self.head_size)
        k_cache = v_cache = kv_scales = None
        if kv_cache is not None:
            k_cache, v_cache, *scales = kv_cache
            kv_scales = tuple(scales) if scales else None
            ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        n_prompt = meta.num_fresh_prompt_tokens
        n_before_decode = n_prompt + meta.num_chunk_tokens
        pieces = []
        if n_prompt:
            pieces.append(ops.prefill_attention(q[:n_prompt], k[:n_prompt], v[:n_prompt],
                                                meta.prompt_lens, self.scale,
                                                window=self.sliding_window))
        if n_before_decode > n_prompt:
            pieces.append(ops.paged_prefill_attention(
                q[n_prompt:n_before_decode], k_cache, v_cache, meta.chunk_block_tables,
                meta.chunk_query_start_loc, meta.chunk_context_lens, self.scale, kv_scales,
                window=self.sliding_window))
        if T > n_before_decode:
            pieces.append(ops.paged_attention(q[n_before_decode:], k_cache, v_cache,
                                              meta.block_tables, meta.context_lens, self.scale,
                                              meta.max_context_len, kv_scales,
                                              window=self.sliding_window))
        if not pieces:
            return query.new_zeros(0, self.num_heads * self.head_size)
        return torch.cat(pieces).reshape(T, self.num_heads * self.head_size)
