"""The attention and cache operations in plain torch: the reference (lessons 02, 05 and 08).

These functions are written to be obviously right. The CUDA kernels of ``csrc/``, the C++ CPU op
of ``csrc/cpu/attention.cpp``, the CUDA-on-CPU build and the NumPy emulator are all checked
against them, and ``minipaged.kernels.ops`` runs them wherever no compiled op takes the call.
This module imports no back-end: it depends on torch only.

The KV cache layout (one layout everywhere):

    key_cache   [num_blocks, num_kv_heads, head_size // x, block_size, x]   x = 16 // element_size
    value_cache [num_blocks, num_kv_heads, head_size, block_size]

A token's *slot* is ``physical_block_number * block_size + offset_in_block``.

An 8-bit cache (``kv_cache_dtype`` "fp8" or "int8", lesson 18) holds codes in these tensors and
one float32 scale per token and kv head beside them, ``kv_scales = (key_scales, value_scales)``
each ``[num_blocks, num_kv_heads, block_size]`` (``minipaged.kernels.kv_quant``): writing
quantizes, reading dequantizes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minipaged.kernels import kv_quant


# ----------------------------------------------------------------------------------------------
# Writing new keys and values into their slots
# ----------------------------------------------------------------------------------------------
def reshape_and_cache(
    key: torch.Tensor,  # (T, num_kv_heads, head_size)
    value: torch.Tensor,  # (T, num_kv_heads, head_size)
    key_cache: torch.Tensor,  # (num_blocks, num_kv_heads, head_size // x, block_size, x)
    value_cache: torch.Tensor,  # (num_blocks, num_kv_heads, head_size, block_size)
    slot_mapping: torch.Tensor,  # (T,) int, -1 = padding token, not cached
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # 2 x (num_blocks, kv_heads, bs)
) -> None:
    """Write each token's key and value into the cache slot ``slot_mapping[token]``.

    A slot is in ``[0, num_blocks * block_size)``, or -1 for a token that is not cached (vLLM's
    padding slot); anything below -1 raises a ValueError naming it. With ``kv_scales`` (an
    8-bit cache) each token's key and value are quantized per kv head, codes into the cache and
    scales into ``kv_scales``.
    """
    num_tokens, num_kv_heads, head_size = key.shape
    block_size, x = key_cache.shape[3], key_cache.shape[4]
    if slot_mapping.numel() and int(slot_mapping.min()) < -1:
        raise ValueError(f"slot_mapping holds {int(slot_mapping.min())}: a slot is >= 0, or -1 "
                         "for a token that is not cached")
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()  # (T',)
    block_idx = slots // block_size  # (T',)
    offset = slots % block_size  # (T',)
    key, value = key[keep], value[keep]  # (T', kv_heads, head_size)
    if kv_scales is not None:
        key, key_scale = kv_quant.quantize(key, key_cache.dtype)  # codes, (T', kv_heads)
        value, value_scale = kv_quant.quantize(value, value_cache.dtype)
        kv_scales[0][block_idx, :, offset] = key_scale  # (T', kv_heads)
        kv_scales[1][block_idx, :, offset] = value_scale
    # Advanced indices on dims 0 and 3 put the token dim first: (T', kv_heads, head_size//x, x)
    key_cache[block_idx, :, :, offset, :] = key.reshape(-1, num_kv_heads, head_size // x, x)
    # (T', kv_heads, head_size)
    value_cache[block_idx, :, :, offset] = value


# ----------------------------------------------------------------------------------------------
# Decode: one query token per sequence, keys and values read through the block table
# ----------------------------------------------------------------------------------------------
def gather_kv(key_cache, value_cache, block_tables, kv_scales=None):
    """Read every sequence's cached keys and values into padded dense tensors.

    Returns keys and values of shape (num_seqs, num_kv_heads, max_blocks * block_size, head_size);
    positions past a sequence's context length hold whatever the padding blocks contain. With
    ``kv_scales`` (an 8-bit cache) they come back dequantized, in float32.
    """
    num_seqs, max_blocks = block_tables.shape
    _, num_kv_heads, _, block_size, _ = key_cache.shape
    head_size = value_cache.shape[2]
    tables = block_tables.long()
    k = key_cache[tables]  # (S, B, kv_heads, head_size//x, block_size, x)
    k = k.permute(0, 2, 1, 4, 3, 5)  # (S, kv_heads, B, block_size, head_size//x, x)
    k = k.reshape(num_seqs, num_kv_heads, max_blocks * block_size, head_size)
    v = value_cache[tables]  # (S, B, kv_heads, head_size, block_size)
    v = v.permute(0, 2, 1, 4, 3)  # (S, kv_heads, B, block_size, head_size)
    v = v.reshape(num_seqs, num_kv_heads, max_blocks * block_size, head_size)
    if kv_scales is not None:
        scales = [sc[tables].permute(0, 2, 1, 3)  # (S, kv_heads, B, block_size)
                  .reshape(num_seqs, num_kv_heads, max_blocks * block_size) for sc in kv_scales]
        k = kv_quant.dequantize(k, scales[0])  # (S, kv_heads, L, head_size)
        v = kv_quant.dequantize(v, scales[1])
    return k, v


def paged_attention(
    query: torch.Tensor,  # (num_seqs, num_heads, head_size)
    key_cache: torch.Tensor,  # (num_blocks, num_kv_heads, head_size // x, block_size, x)
    value_cache: torch.Tensor,  # (num_blocks, num_kv_heads, head_size, block_size)
    block_tables: torch.Tensor,  # (num_seqs, max_num_blocks_per_seq) int
    context_lens: torch.Tensor,  # (num_seqs,) int
    scale: float,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None,
) -> torch.Tensor:  # (num_seqs, num_heads, head_size)
    """Single-query attention of each sequence's newest token over its cached context.

    Query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)`` (grouped-query attention).
    ``kv_scales``: an 8-bit cache's scales (see ``reshape_and_cache``). ``window``: a sliding
    window's tokens; the newest token then sees only the ``window`` newest positions
    ``context_len - window ... context_len - 1`` (the blocks before them are never read, so
    they may have gone back to the free list).
    """
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[1]
    group = num_heads // num_kv_heads  # query heads per kv head
    if num_seqs == 0:
        return torch.empty_like(query)
    k, v = gather_kv(key_cache, value_cache, block_tables, kv_scales)  # (S, kv_heads, L, D) each
    length = k.shape[2]
    q = query.reshape(num_seqs, num_kv_heads, group, head_size).float()  # (S, kv_heads, G, D)
    logits = torch.matmul(q, k.float().transpose(-1, -2)) * scale  # (S, kv_heads, G, L)
    positions = torch.arange(length, device=query.device)  # (L,)
    ctx = context_lens.to(query.device).long()[:, None]  # (S, 1)
    beyond = positions[None, :] >= ctx  # (S, L)
    if window is not None:
        beyond |= positions[None, :] < ctx - window  # left the window
    logits = logits.masked_fill(beyond[:, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # fp32 softmax
    # NOTE: slots past the context hold whatever was there before; zero them so that even NaN
    # garbage cannot leak through (probability 0 times NaN is NaN). gather_kv returned a fresh
    # copy, so it is ours to overwrite in place.
    v = v.float().masked_fill_(beyond[:, None, :, None], 0.0)  # (S, kv_heads, L, D)
    out = torch.matmul(probs, v)  # (S, kv_heads, G, D)
    return out.reshape(num_seqs, num_heads, head_size).to(query.dtype)


# ----------------------------------------------------------------------------------------------
# Prefill: several prompts packed one after another, each attending causally to itself only
# ----------------------------------------------------------------------------------------------
def prefill_attention(
    query: torch.Tensor,  # (T, num_heads, head_size), the prompts packed one after another
    key: torch.Tensor,  # (T, num_kv_heads, head_size)
    value: torch.Tensor,  # (T, num_kv_heads, head_size)
    prompt_lens: list[int],
    scale: float,
    window: int | None = None,
) -> torch.Tensor:  # (T, num_heads, head_size)
    """Causal attention inside each prompt of a packed batch (torch SDPA, one call per prompt).

    ``window``: a sliding window's tokens; position p then sees positions p - window + 1 ... p.
    """
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    start = 0
    for length in prompt_lens:
        end = start + length
        q = query[start:end].transpose(0, 1)  # (heads, len, D)
        k = key[start:end].transpose(0, 1)  # (kv_heads, len, D)
        v = value[start:end].transpose(0, 1)
        if group > 1:
            k = k.repeat_interleave(group, dim=0)  # (heads, len, D)
            v = v.repeat_interleave(group, dim=0)
        # NOTE: a batch dimension of 1 (4-D inputs) lets torch pick its fused flash kernel on
        # the CPU; 3-D inputs fall back to the math path, 5x slower at 1.5k tokens.
        if window is not None and length > window:
            pos = torch.arange(length, device=query.device)  # (len,)
            dist = pos[:, None] - pos[None, :]  # (len, len): query minus key position
            mask = (dist >= 0) & (dist < window)
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                               scale=scale)[0]  # (heads, len, D)
        else:
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                               scale=scale)[0]  # (heads, len, D)
        out[start:end] = o.transpose(0, 1)
        start = end
    return out


# ----------------------------------------------------------------------------------------------
# Prefill over a cached context: new tokens attend to earlier tokens already in the paged cache
# ----------------------------------------------------------------------------------------------
def paged_prefill_attention(
    query: torch.Tensor,  # (T, num_heads, head_size), each sequence's new tokens packed
    key_cache: torch.Tensor,  # (num_blocks, num_kv_heads, head_size // x, block_size, x)
    value_cache: torch.Tensor,  # (num_blocks, num_kv_heads, head_size, block_size)
    block_tables: torch.Tensor,  # (num_seqs, max_num_blocks_per_seq) int
    query_start_loc: torch.Tensor,  # (num_seqs + 1,) int: sequence s owns rows [loc[s], loc[s+1])
    context_lens: torch.Tensor,  # (num_seqs,) int: tokens in the cache incl. the new ones
    scale: float,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None,
) -> torch.Tensor:  # (T, num_heads, head_size)
    """Causal attention of each sequence's newest ``q_len`` tokens over its whole cached context.

    The new tokens are positions ``context_len - q_len ... context_len - 1``; their keys and
    values are already in the cache (``reshape_and_cache`` ran first). Token at position ``p``
    attends to positions ``0..p``. This one operation serves a prompt after a cached prefix, a
    chunk of a long prompt, and the recompute of a sequence that shares its prompt's blocks; a
    decode is the case ``q_len == 1``. ``kv_scales``: an 8-bit cache's scales. ``window``: a
    sliding window's tokens; position ``p`` then attends to ``p - window + 1 .. p`` only.
    """
    num_heads = query.shape[1]
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    locs = query_start_loc.tolist()
    for s, context_len in enumerate(context_lens.tolist()):
        start, end = locs[s], locs[s + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = -(-context_len // block_size)
        # The first block any new token reads: 0, or with a window the one holding the oldest
        # position the first new token sees (the blocks before it may be gone: never read them)
        first = 0 if window is None else max(0, context_len - q_len - window + 1) // block_size
        table = block_tables[s, first:num_blocks].long()
        k, v = gather_kv(key_cache, value_cache, table[None], kv_scales)  # (1, kv_heads, L', D)
        begin = first * block_size  # the position of k's first row
        k = k[0, :, :context_len - begin].float()  # (kv_heads, L, D)
        v = v[0, :, :context_len - begin].float()
        if group > 1:
            k = k.repeat_interleave(group, dim=0)  # (heads, L, D)
            v = v.repeat_interleave(group, dim=0)
        q = query[start:end].transpose(0, 1).float()  # (heads, q_len, D)
        q_pos = torch.arange(context_len - q_len, context_len, device=query.device)  # (q_len,)
        k_pos = torch.arange(begin, context_len, device=query.device)  # (L,)
        allowed = k_pos[None, :] <= q_pos[:, None]  # (q_len, L)
        if window is not None:
            allowed &= k_pos[None, :] > q_pos[:, None] - window
        # 4-D (a batch of 1): torch's fused attention takes it, also on the CPU.
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=allowed,
                                           scale=scale)[0]
        out[start:end] = o.transpose(0, 1).to(query.dtype)  # (q_len, heads, D)
    return out


# ----------------------------------------------------------------------------------------------
# Moving whole blocks: copy-on-write and swapping
# ----------------------------------------------------------------------------------------------
def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: dict[int, list[int]],
) -> None:
    """Copy-on-write: copy block ``src`` to every ``dst`` in ``block_mapping[src]``, every layer."""
    if not block_mapping:
        return
    src = [s for s, dsts in block_mapping.items() for _ in dsts]
    dst = [d for dsts in block_mapping.values() for d in dsts]
    src_t = torch.tensor(src, dtype=torch.long, device=key_caches[0].device)
    dst_t = torch.tensor(dst, dtype=torch.long, device=key_caches[0].device)
    for key_cache, value_cache in zip(key_caches, value_caches):
        key_cache[dst_t] = key_cache[src_t]
        value_cache[dst_t] = value_cache[src_t]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: dict[int, int]) -> None:
    """Copy blocks between two caches of one layer (GPU <-> CPU): ``dst[d] = src[s]``."""
    for s, d in block_mapping.items():
        dst[d].copy_(src[s], non_blocking=src.is_cuda or dst.is_cuda)


# ----------------------------------------------------------------------------------------------
# The small operations between a LLaMA layer's matmuls (csrc/layer_kernels.cu runs them on a GPU)
# ----------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))``, the norm in float32 and rounded to x's dtype
    before the weight multiplies it, as transformers computes LLaMA's RMSNorm."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: the residual stream's add and the next norm."""
    total = x + residual
    return rms_norm(total, weight, eps), total


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, H, D) and k (T, KVH, D) rotated by their positions (rotate-half layout), with the
    tables cos and sin (max_position, D) in q's dtype."""
    c = cos[positions][:, None, :]  # (T, 1, D)
    s = sin[positions][:, None, :]
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: LLaMA's SwiGLU between its two MLP matmuls."""
    return F.silu(gate) * up
