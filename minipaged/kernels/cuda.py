"""Our CUDA kernels, compiled just in time (lesson 05).

``load()`` builds ``csrc/*.cu`` and ``csrc/torch_bindings.cpp`` with
``torch.utils.cpp_extension.load`` the first time it is called on a machine with a CUDA GPU, and
returns an object with the four cache/attention operations:

    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale,
                    max_context_len=None, out=None, version=0) -> out
    copy_blocks(key_caches, value_caches, block_mapping: dict[int, list[int]])
    swap_blocks(src, dst, block_mapping: dict[int, int])

It returns None (and ``minipaged.kernels.ops`` falls back to its plain torch code) when there is no GPU,
torch is a CPU build, ``MINIPAGED_NO_CUDA_KERNELS=1`` is set, or the build fails; a failed build
is reported once with ``warnings.warn``. The result is cached for the life of the process; the
compiled library is cached on disk under ``~/.cache/minipaged/torch_ext`` (or
``$MINIPAGED_EXT_DIR``), keyed by torch version and GPU architecture, and rebuilt when a source
file changes.

``xformers_prefill`` is the optional fast path for prompt (prefill) attention.

Importing this module is cheap and never fails: torch is imported only inside the functions.
"""
from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = ("torch_bindings.cpp", "paged_attention.cu", "cache_kernels.cu")

_lock = threading.Lock()
_loaded = False
_kernels = None  # a CudaKernels, or None when the kernels are not available


def load():
    """The compiled kernels as a ``CudaKernels`` object, or None where they cannot be used."""
    global _loaded, _kernels
    if _loaded:
        return _kernels
    with _lock:
        if not _loaded:
            _kernels = _build()
            _loaded = True
    return _kernels


def _build():
    if os.environ.get("MINIPAGED_NO_CUDA_KERNELS", "") not in ("", "0"):
        return None
    try:
        import torch
    except ImportError:
        return None
    if torch.version.cuda is None or not torch.cuda.is_available():
        return None  # a CPU (or ROCm) build of torch, or no GPU: the torch reference runs
    try:
        from torch.utils import cpp_extension

        _make_ninja_findable(cpp_extension)
        major, minor = torch.cuda.get_device_capability()
        arch = f"{major}{minor}"
        cache_root = Path(
            os.environ.get("MINIPAGED_EXT_DIR", Path.home() / ".cache" / "minipaged" / "torch_ext")
        )
        build_dir = cache_root / f"torch{torch.__version__}-cuda{torch.version.cuda}-sm{arch}"
        build_dir.mkdir(parents=True, exist_ok=True)
        # NOTE: an explicit -gencode for this GPU only: a quick build, and torch adds no arch
        # flags of its own when it sees one among ours. No -std flag: torch picks the C++
        # standard its own headers need (the .cu files are plain C++17 and build with either).
        cuda_flags = ["-O2", f"-gencode=arch=compute_{arch},code=sm_{arch}"]
        module = cpp_extension.load(
            name=f"minipaged_cuda_sm{arch}",
            sources=[str(CSRC / s) for s in SOURCES],
            extra_cflags=["-O2"],
            extra_cuda_cflags=cuda_flags,
            build_directory=str(build_dir),
            verbose=os.environ.get("MINIPAGED_VERBOSE_BUILD", "") not in ("", "0"),
        )
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the torch reference"
        warnings.warn(
            "minipaged: building the CUDA kernels failed, so the plain torch reference runs "
            f"instead (slower).\n{type(exc).__name__}: {exc}",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return CudaKernels(module)


def _make_ninja_findable(cpp_extension) -> None:
    """torch's JIT builds need ninja; the pip package 'ninja' ships one outside PATH."""
    if cpp_extension.is_ninja_available():
        return
    try:
        import ninja  # type: ignore[import-not-found]
    except ImportError:
        return  # cpp_extension.load raises a clear error of its own
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


SUPPORTED_HEAD_SIZES = (64, 80, 96, 112, 128, 256)  # the template instances in paged_attention.cu
SUPPORTED_BLOCK_SIZES = (8, 16, 32)
_warned_shapes: set = set()


class CudaKernels:
    """Thin Python wrappers: argument conversion here, checks in torch_bindings.cpp."""

    def __init__(self, module):
        self.module = module  # the compiled extension

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        import torch

        slot_mapping = slot_mapping.to(device=key_cache.device, dtype=torch.long).contiguous()
        self.module.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def paged_attention(
        self, query, key_cache, value_cache, block_tables, context_lens, scale,
        max_context_len=None, out=None, version=0,
    ):
        """Decode attention into ``out`` (allocated if None); returns ``out``.

        ``version`` 0 lets the kernel choose by context length (``paged_attention_plan``):
        V1, one CUDA block per (head, sequence), or V2, which also splits the context into
        512-token partitions. 1 or 2 forces one (tests, benchmarks).

        Every context must hold at least one token (the query's own). ``context_lens`` on the
        host is checked here, for free, before it is copied to the GPU; lengths already on the
        GPU are not read back (that would cost a synchronisation per call): there the kernel
        writes zeros for an empty context and NaN for one longer than ``max_context_len``.
        """
        import torch

        if context_lens.device.type == "cpu" and context_lens.numel():
            shortest = int(context_lens.min())
            if shortest < 1:
                seq = int(torch.argmin(context_lens))
                raise ValueError(f"context_lens[{seq}] = {shortest}: every sequence's context "
                                 "holds at least its query's own token (>= 1)")

        head_size, block_size = query.shape[-1], key_cache.shape[3]
        if (head_size not in SUPPORTED_HEAD_SIZES or block_size not in SUPPORTED_BLOCK_SIZES
                or query.dtype not in (torch.float32, torch.float16, torch.bfloat16)):
            # NOTE: a model whose head size the kernel was not built for still runs, on the
            # (slower) torch reference, instead of failing in the middle of generation.
            return self._reference(query, key_cache, value_cache, block_tables, context_lens,
                                   scale, out)
        block_tables = block_tables.to(device=query.device, dtype=torch.int32).contiguous()
        context_lens = context_lens.to(device=query.device, dtype=torch.int32).contiguous()
        if max_context_len is None:
            max_context_len = int(context_lens.max().item()) if context_lens.numel() else 0
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if query.stride(-1) != 1:
            query = query.contiguous()
        self.module.paged_attention(
            out, query, key_cache, value_cache, block_tables, context_lens,
            float(scale), int(max_context_len), int(version),
        )
        return out

    def paged_attention_plan(self, num_seqs, num_heads, head_size, max_context_len, version=0):
        """The kernel version (1 or 2) that runs for such a batch, and its workspace bytes."""
        chosen, workspace = self.module.paged_attention_plan(num_seqs, num_heads, head_size,
                                                             max_context_len, version)
        return chosen, workspace

    def v1_limits(self, head_size, block_size, dtype):
        """(static shared bytes, longest context) of the V1 kernel on the current device."""
        import torch

        code = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[dtype]
        static_bytes, longest = self.module.paged_attention_v1_limits(head_size, block_size, code)
        return static_bytes, longest

    @staticmethod
    def _reference(query, key_cache, value_cache, block_tables, context_lens, scale, out):
        from minipaged.kernels.ops import paged_attention_ref

        key = (query.shape[-1], key_cache.shape[3], query.dtype)
        if key not in _warned_shapes:
            _warned_shapes.add(key)
            warnings.warn(
                f"minipaged: the CUDA paged-attention kernel is built for head sizes "
                f"{SUPPORTED_HEAD_SIZES}, block sizes {SUPPORTED_BLOCK_SIZES} and fp32/fp16/bf16; "
                f"head size {key[0]}, block size {key[1]}, {key[2]} use the torch reference",
                RuntimeWarning,
                stacklevel=4,
            )
        result = paged_attention_ref(query, key_cache, value_cache, block_tables, context_lens,
                                     scale)
        if out is None:
            return result
        out.copy_(result)
        return out

    def copy_blocks(self, key_caches, value_caches, block_mapping) -> None:
        pairs = [(src, dst) for src, dsts in block_mapping.items() for dst in dsts]
        if pairs:
            self.module.copy_blocks(list(key_caches), list(value_caches), _pairs_tensor(pairs))

    def swap_blocks(self, src, dst, block_mapping) -> None:
        if block_mapping:
            self.module.swap_blocks(src, dst, _pairs_tensor(list(block_mapping.items())))


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
