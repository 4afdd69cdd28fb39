"""The Python side of our CUDA kernels, ``csrc/*.cu`` + ``csrc/torch_bindings.cpp`` (lessons 05, 06).

``minipaged.kernels.build.CUDA_OP.load()`` compiles them (once, on a machine with a CUDA GPU
and a CUDA build of torch) and returns a ``CudaKernels``; ``minipaged.kernels.cuda_on_cpu``
builds the same files for the CPU and wraps them in the same class. Its operations::

    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale,
                    max_context_len=None, out=None, version=0, kv_scales=None,
                    window=None) -> out
    copy_blocks(key_caches, value_caches, block_mapping: dict[int, list[int]])
    swap_blocks(src, dst, block_mapping: dict[int, int])
    gguf_linear(x, blocks, ggml_type) -> x W^T   (W as GGUF blocks: csrc/gguf_matmul.cu)

The paged-attention kernel is instantiated for the head sizes, block sizes and dtypes below
(``supports_paged_attention``); ``minipaged.kernels.ops`` sends other shapes to the torch
reference. ``xformers_prefill`` is the optional fast path for prompt (prefill) attention.

Importing this module is cheap and never fails: torch is imported only inside the functions.
"""
from __future__ import annotations

SUPPORTED_HEAD_SIZES = (64, 80, 96, 112, 128, 256)  # the template instances in paged_attention.cu
SUPPORTED_BLOCK_SIZES = (8, 16, 32)
# an 8-bit cache (lesson 18): phase 4 reads 16 one-byte codes (16 tokens) of a value row at once
SUPPORTED_8BIT_HEAD_SIZES = (64, 128)
SUPPORTED_8BIT_BLOCK_SIZES = (16, 32)
# the grouped kernel (version 3): one CUDA block per kv head serves its whole group of query heads
GROUPED_HEAD_SIZES = (64, 128)
MAX_GROUP = 8  # query heads per kv head


class CudaKernels:
    """Thin Python wrappers: argument conversion here, checks in torch_bindings.cpp."""

    supports_8bit_cache = True  # ``kv_scales`` (lesson 18): the ``_8bit`` entry points
    supports_window = True  # ``window``: every decode kernel (V1, V2, version 3, 8-bit caches)

    def __init__(self, module):
        self.module = module  # the compiled extension

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping,
                          kv_scales=None) -> None:
        import torch

        if slot_mapping.device.type == "cpu" and slot_mapping.numel():
            _check_slots(slot_mapping, key_cache.shape[0] * key_cache.shape[3])
        slot_mapping = slot_mapping.to(device=key_cache.device, dtype=torch.long).contiguous()
        if kv_scales is not None:
            return self.module.reshape_and_cache_8bit(key, value, key_cache, value_cache,
                                                      *kv_scales, slot_mapping)
        self.module.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def paged_attention(
        self, query, key_cache, value_cache, block_tables, context_lens, scale,
        max_context_len=None, out=None, version=0, kv_scales=None, window=None,
    ):
        """Decode attention into ``out`` (allocated if None); returns ``out``.

        ``version`` 0 lets the kernel choose (``paged_attention_plan``): V1, one CUDA block per
        (head, sequence), or V2, which also splits the context into partitions of 64 to 512
        tokens (shorter ones when few sequences run), or, when query heads share a kv head
        (grouped-query attention, at most 8 per kv head, head size 64 or 128, a 16- or 32-bit
        cache), version 3: one CUDA block per (kv head, sequence, partition) that reads each key
        and value once for the whole group. 1, 2 or 3 forces one (tests, benchmarks; a forced V2
        or 3 has 512-token partitions; 3 is refused where it is not built).

        Every context must hold at least one token (the query's own). ``context_lens`` on the
        host is checked here, for free, before it is copied to the GPU; lengths already on the
        GPU are not read back (that would cost a synchronisation per call): there the kernel
        writes zeros for an empty context and NaN for one longer than ``max_context_len``.
        ``kv_scales``: an 8-bit cache's (key_scales, value_scales) (lesson 18).

        ``window``: None (or 0) for the whole context, or a sliding window's tokens: the newest
        token sees positions ``context_len - window .. context_len - 1`` only. Every version
        starts at the window's first block, masks that block's tokens before the window, and
        never reads a block wholly before it (V2 and version 3 skip the partitions that lie
        wholly before it), so those blocks may already be back on the free list.
        """
        import torch

        window = _window_tokens(window)
        if context_lens.device.type == "cpu" and context_lens.numel():
            shortest = int(context_lens.min())
            if shortest < 1:
                seq = int(torch.argmin(context_lens))
                raise ValueError(f"context_lens[{seq}] = {shortest}: every sequence's context "
                                 "holds at least its query's own token (>= 1)")

        if not self.supports_paged_attention(query, key_cache):
            unsupported = [f"query dtype {query.dtype}"] if query.dtype not in (
                torch.float32, torch.float16, torch.bfloat16) else []
            if query.shape[-1] not in SUPPORTED_HEAD_SIZES:
                unsupported.append(f"head size {query.shape[-1]}")
            if key_cache.shape[3] not in SUPPORTED_BLOCK_SIZES:
                unsupported.append(f"key_cache block size {key_cache.shape[3]}")
            raise ValueError(
                f"{', '.join(unsupported)}: the paged-attention kernel is built for head sizes "
                f"{SUPPORTED_HEAD_SIZES}, block sizes {SUPPORTED_BLOCK_SIZES} and fp32/fp16/bf16, "
                f"not head size {query.shape[-1]}, block size {key_cache.shape[3]}, "
                f"{query.dtype} (minipaged.kernels.ops runs the torch reference for those)")
        if block_tables.device.type == "cpu" and context_lens.device.type == "cpu":
            _check_block_numbers(block_tables, context_lens, key_cache.shape[0],
                                 key_cache.shape[3])
        block_tables = block_tables.to(device=query.device, dtype=torch.int32).contiguous()
        context_lens = context_lens.to(device=query.device, dtype=torch.int32).contiguous()
        if max_context_len is None:
            max_context_len = int(context_lens.max().item()) if context_lens.numel() else 0
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if query.stride(-1) != 1:
            query = query.contiguous()
        if kv_scales is not None:
            self.module.paged_attention_8bit(
                out, query, key_cache, value_cache, *kv_scales, block_tables, context_lens,
                float(scale), int(max_context_len), int(version), window)
            return out
        self.module.paged_attention(
            out, query, key_cache, value_cache, block_tables, context_lens,
            float(scale), int(max_context_len), int(version), window,
        )
        return out

    @staticmethod
    def supports_paged_attention(query, key_cache) -> bool:
        """Whether the kernel was instantiated for this head size, block size and dtype.

        Args:
            query: (num_seqs, num_heads, head_size).
            key_cache: (num_blocks, num_kv_heads, head_size // x, block_size, x).
        """
        import torch

        if key_cache.element_size() == 1:  # an 8-bit cache (lesson 18)
            return (query.shape[-1] in SUPPORTED_8BIT_HEAD_SIZES
                    and key_cache.shape[3] in SUPPORTED_8BIT_BLOCK_SIZES
                    and query.dtype in (torch.float32, torch.float16, torch.bfloat16))
        return (query.shape[-1] in SUPPORTED_HEAD_SIZES
                and key_cache.shape[3] in SUPPORTED_BLOCK_SIZES
                and query.dtype in (torch.float32, torch.float16, torch.bfloat16))

    def paged_attention_plan(self, num_seqs, num_heads, head_size, max_context_len, version=0,
                             num_kv_heads=None, cache_8bit=False):
        """(version, workspace bytes, partition size) for such a batch on the current device.

        The version (1, 2 or 3 = grouped) that runs; its workspace in bytes and its partition
        size in tokens (0 for V1). With ``version=0`` the plan also shrinks the partitions from
        512 tokens down to 64 while the grid has fewer than 4 CUDA blocks per SM (few sequences,
        long contexts: batch 1 at 4,096 tokens); a forced ``version=2`` or 3 keeps 512 tokens.
        ``num_kv_heads`` defaults to ``num_heads`` (no query heads share a kv head);
        ``cache_8bit`` plans for an 8-bit cache (lesson 18), which has no grouped kernel.
        """
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        cache_dtype = 3 if cache_8bit else 0  # only 8-bit or not matters to the plan
        chosen, workspace, partition_size = self.module.paged_attention_plan(
            num_seqs, num_heads, num_kv_heads, head_size, max_context_len, cache_dtype, version)
        return chosen, workspace, partition_size

    def force_partition_size(self, tokens: int) -> None:
        """Every later V2 (and version 3) call uses ``tokens``-token partitions (64, 128, 256
        or 512); 0 lets the plan choose again. For benchmarks that compare partition sizes."""
        self.module.force_partition_size(int(tokens))

    def set_v2_reduce(self, mode: int) -> None:
        """How every later V2 (and version 3) call combines its partitions: 0 = a reduce kernel
        of its own (the default), 1 = fused, by the partitions' last CUDA block (no second
        launch; contexts of more than 512 partitions keep the reduce kernel). For benchmarks
        and tests that compare the two; the plan's workspace follows the mode."""
        self.module.set_v2_reduce(int(mode))

    def v1_limits(self, head_size, block_size, dtype):
        """(static shared bytes, longest context) of the V1 kernel on the current device."""
        import torch

        code = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[dtype]
        static_bytes, longest = self.module.paged_attention_v1_limits(head_size, block_size, code)
        return static_bytes, longest

    # -- the small operations between a LLaMA layer's matmuls (csrc/layer_kernels.cu) -----------
    def rms_norm(self, x, weight, eps):
        """``weight * rms_norm(x)`` over the last dimension, as ``reference.rms_norm``."""
        import torch

        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty_like(rows)
        self.module.rms_norm(out, rows, None, None, weight, float(eps))
        return out.view(x.shape)

    def add_rms_norm(self, x, residual, weight, eps):
        """``(rms_norm(x + residual), x + residual)`` in one kernel, as
        ``reference.add_rms_norm``."""
        import torch

        rows, res = x.reshape(-1, x.shape[-1]), residual.reshape(-1, x.shape[-1])
        out, total = torch.empty_like(rows), torch.empty_like(rows)
        self.module.rms_norm(out, rows, res, total, weight, float(eps))
        return out.view(x.shape), total.view(x.shape)

    def rotary(self, positions, q, k, cos, sin):
        """q (T, H, D) and k (T, KVH, D) rotated by their positions, as ``reference.rotary``."""
        import torch

        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        self.module.rotary(q_out, k_out, q, k, positions.to(torch.long), cos, sin)
        return q_out, k_out

    def silu_and_mul(self, gate, up):
        """``silu(gate) * up``, as ``reference.silu_and_mul``."""
        import torch

        if not (gate.dim() == 2 and gate.stride(1) == 1 and up.stride(1) == 1):
            gate, up = gate.contiguous(), up.contiguous()  # (rows at a stride need no copy)
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        self.module.silu_and_mul(out, gate, up)
        return out

    # -- x W^T with W as GGUF blocks (csrc/gguf_matmul.cu, models/gguf_linear.py's ``cuda``) -----
    def gguf_linear(self, x, blocks, ggml_type):
        """``x W^T`` for x (..., in) and W as uint8 rows of GGUF blocks of format ``ggml_type``
        (the file's number), dequantized inside the dot product; x's dtype out."""
        rows = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x
        if rows.dim() == 2 and rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = self.module.gguf_linear(rows, blocks, int(ggml_type))
        return out.view(*x.shape[:-1], out.shape[-1]) if x.dim() > 1 else out

    def copy_blocks(self, key_caches, value_caches, block_mapping) -> None:
        pairs = [(src, dst) for src, dsts in block_mapping.items() for dst in dsts]
        if pairs:
            self.module.copy_blocks(list(key_caches), list(value_caches), _pairs_tensor(pairs))

    def swap_blocks(self, src, dst, block_mapping) -> None:
        if block_mapping:
            self.module.swap_blocks(src, dst, _pairs_tensor(list(block_mapping.items())))


# NOTE: block numbers and slots that are still on the host are checked here, for free, before
# they are copied to the GPU (a RuntimeError, as the binding's own checks raise): there the kernels cannot check them without a synchronisation, and
# one past the pool would read or write another tensor's memory. (The CPU build's binding checks
# them again: harmless.)
def _check_block_numbers(block_tables, context_lens, num_blocks: int, block_size: int) -> None:
    """Every block a sequence's context uses must be a block of the cache."""
    import torch

    width = block_tables.shape[1] if block_tables.dim() == 2 else 0
    if block_tables.dim() != 2 or context_lens.dim() != 1 or not context_lens.numel():
        return  # the binding refuses such shapes with its own message
    rows = min(block_tables.shape[0], context_lens.shape[0])
    needed = (context_lens[:rows].long().clamp(min=0) + block_size - 1) // block_size  # (rows,)
    used = torch.arange(width)[None, :] < needed[:, None]  # (rows, width)
    tables = block_tables[:rows].long()
    bad = used & ((tables < 0) | (tables >= num_blocks))
    if bad.any():
        seq, col = (int(i) for i in bad.nonzero()[0])
        raise RuntimeError(f"block_tables[{seq}, {col}] = {int(tables[seq, col])} is not a block "
                         f"of the cache ({num_blocks} blocks)")


def _window_tokens(window) -> int:
    """The kernels' ``window`` argument: None or 0 = the whole context, else the tokens."""
    if window is None:
        return 0
    if isinstance(window, bool) or int(window) != window or window < 0:
        raise ValueError(f"window must be None or a number of tokens >= 0, got {window!r}")
    return int(window)


def _check_slots(slot_mapping, num_slots: int) -> None:
    """Every slot must be -1 (not cached) or a slot of the cache."""
    slots = slot_mapping.long().reshape(-1)
    bad = ((slots < -1) | (slots >= num_slots)).nonzero()
    if bad.numel():
        token = int(bad[0])
        raise RuntimeError(f"slot_mapping[{token}] = {int(slots[token])} is outside the cache's "
                         f"slots [-1, {num_slots})")


def _pairs_tensor(pairs):
    import torch

    return torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)  # (num_pairs, 2) on the CPU


# ----------------------------------------------------------------------------------------------
# Prefill through xformers (optional)
# ----------------------------------------------------------------------------------------------
def xformers_prefill(query, key, value, prompt_lens, scale):
    """Causal attention of packed prompts with xformers' block-diagonal mask, or None.

    ``query`` is (T, num_heads, head_size) with the prompts one after another, ``key`` and
    ``value`` are (T, num_kv_heads, head_size). Returns (T, num_heads, head_size), or None when
    xformers is not installed or the tensors are not on a GPU (the caller then uses SDPA).
    """
    if not getattr(query, "is_cuda", False):
        return None
    try:
        from xformers import ops as xops
        from xformers.ops.fmha.attn_bias import BlockDiagonalCausalMask
    except Exception:  # noqa: BLE001 - not installed, or installed but broken
        return None
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    if num_kv_heads != num_heads:  # grouped-query attention: repeat each kv head for its group
        group = num_heads // num_kv_heads
        key = key[:, :, None, :].expand(num_tokens, num_kv_heads, group, head_size)
        key = key.reshape(num_tokens, num_heads, head_size)  # (T, heads, D)
        value = value[:, :, None, :].expand(num_tokens, num_kv_heads, group, head_size)
        value = value.reshape(num_tokens, num_heads, head_size)  # (T, heads, D)
    bias = BlockDiagonalCausalMask.from_seqlens([int(n) for n in prompt_lens])
    out = xops.memory_efficient_attention_forward(
        query[None], key[None], value[None], attn_bias=bias, scale=scale
    )  # (1, T, heads, D): xformers takes batch 1 with all prompts packed
    return out.view(num_tokens, num_heads, head_size)
