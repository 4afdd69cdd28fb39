"""The attention and cache operations the model and the cache engine call (lessons 02, 05, 06).

Each function here decides, in this one place, which back-end runs it:

- CUDA tensors: our CUDA kernels (``minipaged.kernels.cuda_kernels``), unless ``MINIPAGED_CUDA_OP=0``
  is set, the build failed, or the kernel was not built for the shape;
- CPU tensors: the C++ CPU op (``minipaged.kernels.cpu_kernels``) for the operations it has, unless
  ``MINIPAGED_CPU_OP=0`` is set or the build failed;
- everywhere else: the plain torch reference (``minipaged.kernels.reference``).

Both switches follow one convention: "0" turns the op off, anything else (or unset) leaves it on.
The compiled ops are built on first use (``minipaged.kernels.build``). ``calls`` counts which
back-end ran each operation, so tests, lessons and benchmarks can check that a compiled op, not
the reference, did the work::

    ops.calls["paged_attention", "cuda"]      # also "cpu", "reference" (and "xformers")

The KV cache layout is the reference's (``minipaged.kernels.reference``): keys
``[num_blocks, num_kv_heads, head_size // x, block_size, x]`` with ``x = key_vector_size(dtype)``,
values ``[num_blocks, num_kv_heads, head_size, block_size]``.
"""
from __future__ import annotations

import collections
import warnings

import torch

from minipaged.kernels import build, reference
from minipaged.kernels.cuda_kernels import (SUPPORTED_BLOCK_SIZES, SUPPORTED_HEAD_SIZES,
                                       xformers_prefill)

calls: collections.Counter = collections.Counter()  # (operation, back-end) -> number of calls

CPU_OP_MAX_CHUNK = 32  # new tokens per sequence (on average) below which the C++ op runs

# A stand-in for the decode attention of CPU tensors, called with ``paged_attention``'s
# arguments; None: the back-ends above. Lesson 16's capstone puts the learner's CUDA phase 3 of
# lesson 06 here (``minipaged.lab.kernel_exercise.ExerciseKernel``), counted as "exercise".
DECODE_STAND_IN = None


def key_vector_size(dtype: torch.dtype) -> int:
    """How many elements fit in one 16-byte vector: the ``x`` of the key cache layout."""
    return 16 // torch.tensor([], dtype=dtype).element_size()


def backend(tensor: torch.Tensor) -> str:
    """Which back-end runs the attention for ``tensor``: "cuda", "cpu" or "reference".

    Args:
        tensor: a KV cache (or any tensor) on the device the operation runs on.
    """
    return _pick(tensor)[0]


def _pick(tensor: torch.Tensor):
    """(back-end name, compiled op or None) for ``tensor``'s device; waits for a build, except
    for a background compile of the CPU op (the torch reference runs meanwhile).

    The op is a ``CudaKernels`` for a CUDA tensor, a ``CpuKernels`` for a CPU tensor, or None
    where that op is switched off, cannot be built, or the device has none.
    """
    if tensor.is_cuda:
        op = build.CUDA_OP.load()
    elif tensor.device.type == "cpu":
        # NOTE: a first run does not wait for the compiler: the reference runs meanwhile
        op = build.CPU_OP.load_unless_compiling()
    else:
        op = None
    if op is None:
        return "reference", None
    return ("cuda" if tensor.is_cuda else "cpu"), op


def _pick_for_cache(key_cache: torch.Tensor, kv_scales, window: int | None = None):
    """``_pick`` for an operation on a KV cache: an 8-bit cache (``kv_scales`` given) goes to
    the compiled op only where it reads 8-bit caches (``supports_8bit_cache``), else to the
    reference, which always does (lesson 18); a sliding window likewise only where the op
    reads windows (``supports_window``: the C++ CPU op and the CUDA decode kernels)."""
    name, op = _pick(key_cache)
    if kv_scales is not None and not getattr(op, "supports_8bit_cache", False):
        return "reference", None
    if window is not None and not getattr(op, "supports_window", False):
        # NOTE: never a compiled op that would read the whole context: the reference's
        # answer, slower, and counted as "reference" in ``calls`` for all to see
        _warn_no_window_once(name)
        return "reference", None
    return name, op


# ----------------------------------------------------------------------------------------------
# The operations
# ----------------------------------------------------------------------------------------------
def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                      kv_scales=None) -> None:
    """Write each token's key and value into the cache slot ``slot_mapping[token]``.

    Args:
        key, value: (T, num_kv_heads, head_size).
        key_cache, value_cache: one layer's caches.
        slot_mapping: (T,) int; -1 is a token that is not cached. The C++ CPU op, the reference
            and the CUDA build on the CPU refuse a slot below -1 or past the pool with an error
            naming it; the CUDA kernel on a GPU, which cannot look at device data without a
            synchronisation, skips every negative slot.
        kv_scales: None, or an 8-bit cache's (key_scales, value_scales): the tokens are then
            quantized as they are written (``kv_quant``, lesson 18).
    """
    name, op = _pick_for_cache(key_cache, kv_scales)
    calls["reshape_and_cache", name] += 1
    run = reference.reshape_and_cache if op is None else op.reshape_and_cache
    scales = {} if kv_scales is None else {"kv_scales": kv_scales}
    return run(key, value, key_cache, value_cache, slot_mapping, **scales)


def paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale,
                    max_context_len: int | None = None, kv_scales=None,
                    window: int | None = None) -> torch.Tensor:
    """Single-query attention of each sequence's newest token over its cached context.

    Args:
        query: (num_seqs, num_heads, head_size); query head ``h`` reads kv head
            ``h // (num_heads // num_kv_heads)`` (grouped-query attention).
        key_cache, value_cache: one layer's caches.
        block_tables: (num_seqs, max_num_blocks_per_seq) int.
        context_lens: (num_seqs,) int.
        scale: the logits' factor, usually ``head_size ** -0.5``.
        max_context_len: the longest context, if the caller knows it (saves the CUDA path a
            synchronisation).
        kv_scales: None, or an 8-bit cache's (key_scales, value_scales).
        window: None, or a sliding window: the newest token sees the ``window`` newest tokens.
    """
    if DECODE_STAND_IN is not None and key_cache.device.type == "cpu":
        calls["paged_attention", "exercise"] += 1
        return DECODE_STAND_IN(query, key_cache, value_cache, block_tables, context_lens, scale,
                               max_context_len, kv_scales, window)
    name, op = _pick_for_cache(key_cache, kv_scales, window)
    if name == "cuda" and not op.supports_paged_attention(query, key_cache):
        # NOTE: a model whose head size the kernel was not built for still runs, on the
        # (slower) torch reference, instead of failing in the middle of generation.
        _warn_unsupported_once(query, key_cache)
        name = "reference"
    calls["paged_attention", name] += 1
    scales = {} if kv_scales is None else {"kv_scales": kv_scales}
    if window is not None:
        scales["window"] = window  # only an op that reads windows gets here with one
    if name == "cuda":
        return op.paged_attention(query, key_cache, value_cache, block_tables, context_lens,
                                  scale, max_context_len, **scales)
    if name == "cpu":
        return op.paged_attention(query, key_cache, value_cache, block_tables, context_lens,
                                  scale, **scales)
    return reference.paged_attention(query, key_cache, value_cache, block_tables, context_lens,
                                     scale, kv_scales, window)


def prefill_attention(query, key, value, prompt_lens: list[int], scale: float,
                      window: int | None = None) -> torch.Tensor:
    """Causal attention inside each prompt of a packed batch (``reference.prefill_attention``).

    Args:
        query: (T, num_heads, head_size), the prompts packed one after another.
        key, value: (T, num_kv_heads, head_size).
        prompt_lens: the prompts' lengths, summing to T.
        scale: the logits' factor.
        window: None, or a sliding window: position p sees positions p - window + 1 ... p.

    On CUDA with xformers installed, its block-diagonal causal attention does all prompts in one
    call (without a window); the result is the same.
    """
    if query.is_cuda and len(prompt_lens) > 1 and window is None:
        out = xformers_prefill(query, key, value, prompt_lens, scale)
        if out is not None:
            calls["prefill_attention", "xformers"] += 1
            return out
    calls["prefill_attention", "reference"] += 1
    return reference.prefill_attention(query, key, value, prompt_lens, scale, window)


def paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc,
                            context_lens, scale, kv_scales=None,
                            window: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context.

    Args:
        query: (T, num_heads, head_size), each sequence's new tokens packed.
        key_cache, value_cache: one layer's caches (the new tokens already written).
        block_tables: (num_seqs, max_num_blocks_per_seq) int.
        query_start_loc: (num_seqs + 1,) int: sequence s owns rows [loc[s], loc[s+1]).
        context_lens: (num_seqs,) int: tokens in the cache incl. the new ones.
        scale: the logits' factor.
        kv_scales: None, or an 8-bit cache's (key_scales, value_scales).
        window: None, or a sliding window: position p sees positions p - window + 1 ... p.

    See ``reference.paged_prefill_attention`` for what it computes.
    """
    # NOTE: on the CPU the C++ op reads the context in place, which wins for a few new tokens
    # per sequence; for long chunks, one dense copy of the context plus torch's fused CPU
    # attention (about 8x the C++ op's FLOP rate at 256 x 1792 tokens) wins.
    short = query.shape[0] < CPU_OP_MAX_CHUNK * max(len(context_lens), 1)
    name, op = _pick_for_cache(key_cache, kv_scales, window)
    if name != "cpu" or not short:
        name, op = "reference", None
    calls["paged_prefill_attention", name] += 1
    run = reference.paged_prefill_attention if op is None else op.paged_prefill_attention
    scales = {} if kv_scales is None else {"kv_scales": kv_scales}
    if window is not None:
        scales["window"] = window
    return run(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale,
               **scales)


def copy_blocks(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                block_mapping: dict[int, list[int]]) -> None:
    """Copy-on-write: copy block ``src`` to every ``dst`` in ``block_mapping[src]``, every layer.

    Args:
        key_caches, value_caches: every layer's caches.
        block_mapping: source block -> the blocks that receive its copy.
    """
    if not block_mapping:
        return
    name, op = _pick(key_caches[0])
    if name != "cuda":  # the C++ CPU op has no block copy: torch indexing does it
        name, op = "reference", None
    calls["copy_blocks", name] += 1
    run = reference.copy_blocks if op is None else op.copy_blocks
    return run(key_caches, value_caches, block_mapping)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: dict[int, int]) -> None:
    """Copy blocks between two caches of one layer (GPU <-> CPU): ``dst[d] = src[s]``.

    Args:
        src, dst: one layer's key (or value) caches, on the GPU and on the CPU (either way).
        block_mapping: source block -> destination block.
    """
    if not block_mapping:
        return
    name, op = _pick(src if src.is_cuda else dst)
    if name != "cuda":  # CPU <-> CPU (tests, lessons): a plain copy
        name, op = "reference", None
    calls["swap_blocks", name] += 1
    run = reference.swap_blocks if op is None else op.swap_blocks
    return run(src, dst, block_mapping)


# ----------------------------------------------------------------------------------------------
# The small operations between a LLaMA layer's matmuls: our CUDA kernels on a GPU (one launch
# each where torch needed 2 to 12), the C++ CPU op for float32 on the CPU (one pass over memory
# each), the torch reference everywhere else
# ----------------------------------------------------------------------------------------------
def _layer_op(tensor: torch.Tensor):
    """("cuda", kernels) for a CUDA tensor when our kernels are on, ("cpu", kernels) for a
    float32 CPU tensor when the C++ CPU op is (csrc/cpu/layers.cpp), else ("reference", None)."""
    if tensor.is_cuda or (tensor.device.type == "cpu" and tensor.dtype == torch.float32):
        name, op = _pick(tensor)
        if op is not None and hasattr(op, "rms_norm"):
            return name, op
    return "reference", None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rms_norm(x)`` (LLaMA's RMSNorm, transformers' arithmetic)."""
    name, op = _layer_op(x)
    calls["rms_norm", name] += 1
    return (reference if op is None else op).rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: the residual add and the next norm."""
    name, op = _layer_op(x)
    calls["add_rms_norm", name] += 1
    return (reference if op is None else op).add_rms_norm(x, residual, weight, eps)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by their positions (RoPE, rotate-half layout)."""
    name, op = _layer_op(q)
    calls["rotary", name] += 1
    return (reference if op is None else op).rotary(positions, q, k, cos, sin)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (LLaMA's SwiGLU)."""
    name, op = _layer_op(gate)
    calls["silu_and_mul", name] += 1
    return (reference if op is None else op).silu_and_mul(gate, up)


_warned_shapes: set = set()
_warned_windows: set = set()


def _warn_no_window_once(backend_name: str) -> None:
    """Say once per back-end that a sliding window runs on the torch reference there."""
    if backend_name == "reference" or backend_name in _warned_windows:
        return
    _warned_windows.add(backend_name)
    warnings.warn(f"minipaged: the {backend_name} attention op reads no sliding window; layers "
                  "with one run on the torch reference", RuntimeWarning, stacklevel=4)


def _warn_unsupported_once(query, key_cache) -> None:
    shape = (query.shape[-1], key_cache.shape[3], query.dtype)
    if shape in _warned_shapes:
        return
    _warned_shapes.add(shape)
    warnings.warn(
        f"minipaged: the CUDA paged-attention kernel is built for head sizes "
        f"{SUPPORTED_HEAD_SIZES}, block sizes {SUPPORTED_BLOCK_SIZES} and fp32/fp16/bf16; head "
        f"size {shape[0]}, block size {shape[1]}, {shape[2]} use the torch reference",
        RuntimeWarning,
        stacklevel=3,
    )
