"""The Python side of the C++ CPU op: paged attention, ``csrc/cpu/attention.cpp`` (lesson 07);
the few-row linear of ``models/cpu_matmul.py`` (``linear.cpp``) and RMSNorm, rotary and
SiLU-and-multiply in float32 (``layers.cpp``, lesson 15).

``minipaged.kernels.build.CPU_OP.load()`` compiles the C++ files (once, cached on disk) and
returns a ``CpuKernels``. Its attention operations have the signatures of their torch references
in ``minipaged.kernels.reference``::

    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale) -> out
    paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc,
                            context_lens, scale) -> out

The C++ code reads the blocks in place (no dense copy of the context) and checks every argument
before its loops run (shapes, dtypes, block numbers within the sequences' contexts, context
lengths, slots): a bad one raises a RuntimeError naming it, its value and the limit, instead of
reading or writing outside a tensor. Slot -1 means "not cached". The wrappers here only convert
integer tensors to the types the C++ code reads.

An 8-bit cache (lesson 18) passes ``kv_scales = (key_scales, value_scales)`` last; the C++
side then runs its ``_8bit`` entry points, which quantize on writing and apply the scales on
reading (``supports_8bit_cache``). A sliding window (``window=``, Mistral and Gemma 3) is read
by both attention operations (``supports_window``): a row sees only its ``window`` newest
positions, and the blocks before the window are never touched.

Importing this module is cheap and never fails: torch is imported only inside the functions.
"""
from __future__ import annotations


class CpuKernels:
    """Thin wrappers around the compiled module: integer tensors to int64/int32, checks in C++."""

    supports_8bit_cache = True  # the ``_8bit`` entry points (lesson 18)
    supports_window = True  # the attention entry points' ``window`` (0: none)

    def __init__(self, module):
        self.module = _Profiled(module)  # the compiled extension, named in torch's profiler

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping,
                          kv_scales=None) -> None:
        """Write each token's key and value into its slot (see ``reference.reshape_and_cache``)."""
        import torch

        slot_mapping = slot_mapping.to(dtype=torch.long).contiguous()
        if kv_scales is not None:
            return self.module.reshape_and_cache_8bit(key, value, key_cache, value_cache,
                                                      *kv_scales, slot_mapping)
        self.module.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def paged_attention(self, query, key_cache, value_cache, block_tables, context_lens, scale,
                        kv_scales=None, window=None):
        """Decode attention through the block table (see ``reference.paged_attention``)."""
        if kv_scales is not None:
            return self.module.paged_attention_8bit(
                _last_dim_contiguous(query), key_cache, value_cache, *kv_scales,
                _int32(block_tables), _int32(context_lens), float(scale), window or 0)
        return self.module.paged_attention(_last_dim_contiguous(query), key_cache, value_cache,
                                           _int32(block_tables), _int32(context_lens),
                                           float(scale), window or 0)

    def paged_prefill_attention(self, query, key_cache, value_cache, block_tables,
                                query_start_loc, context_lens, scale, kv_scales=None,
                                window=None):
        """Causal attention of new tokens over their cached context (see
        ``reference.paged_prefill_attention``)."""
        if kv_scales is not None:
            return self.module.paged_prefill_attention_8bit(
                _last_dim_contiguous(query), key_cache, value_cache, *kv_scales,
                _int32(block_tables), _int32(query_start_loc), _int32(context_lens),
                float(scale), window or 0)
        return self.module.paged_prefill_attention(
            _last_dim_contiguous(query), key_cache, value_cache, _int32(block_tables),
            _int32(query_start_loc), _int32(context_lens), float(scale), window or 0)

    # A LLaMA block's element-wise layers (``csrc/cpu/layers.cpp``), the signatures of their
    # references in ``minipaged.kernels.reference``: float32 runs in C++, anything else there.
    def rms_norm(self, x, weight, eps):
        """``weight * rms_norm(x)`` over the last dimension, as ``reference.rms_norm``."""
        if not _float32(x, weight):
            from minipaged.kernels import reference
            return reference.rms_norm(x, weight, eps)
        return self.module.rms_norm(x.reshape(-1, x.shape[-1]), weight.contiguous(),
                                    float(eps)).view(x.shape)

    def add_rms_norm(self, x, residual, weight, eps):
        """``(rms_norm(x + residual), x + residual)`` in one pass, as ``reference.add_rms_norm``."""
        if not (_float32(x, residual, weight) and x.shape == residual.shape):
            from minipaged.kernels import reference
            return reference.add_rms_norm(x, residual, weight, eps)
        out, total = self.module.add_rms_norm(x.reshape(-1, x.shape[-1]),
                                              residual.reshape(-1, x.shape[-1]),
                                              weight.contiguous(), float(eps))
        return out.view(x.shape), total.view(x.shape)

    def rotary(self, positions, q, k, cos, sin):
        """q (T, H, D) and k (T, KVH, D) rotated by their positions, as ``reference.rotary``."""
        import torch

        if not _float32(q, k, cos, sin):
            from minipaged.kernels import reference
            return reference.rotary(positions, q, k, cos, sin)
        q_out, k_out = self.module.rotary(positions.to(torch.long).contiguous(),
                                          _last_dim_contiguous(q), _last_dim_contiguous(k),
                                          cos.contiguous(), sin.contiguous())
        return q_out, k_out

    def silu_and_mul(self, gate, up):
        """``silu(gate) * up``, as ``reference.silu_and_mul``."""
        if not (_float32(gate, up) and gate.shape == up.shape):
            from minipaged.kernels import reference
            return reference.silu_and_mul(gate, up)
        shape = gate.shape
        return self.module.silu_and_mul(_last_dim_contiguous(gate.reshape(-1, shape[-1])),
                                        _last_dim_contiguous(up.reshape(-1, shape[-1]))
                                        ).view(shape)

    def linear(self, x, weight):
        """``x W^T`` in float32 for a few rows of ``x`` (``csrc/cpu/linear.cpp``, lesson 15):
        x (rows, in) with contiguous rows, weight (out, in) contiguous."""
        return self.module.linear(_last_dim_contiguous(x), weight)


class _Profiled:
    """The compiled module, each function named in ``torch.profiler``'s tables while a profiler
    runs (as ``minipaged_cpu::linear`` and so on): a pybind11 function is not a torch operator,
    so without this its time would be no row of the table (``scripts/profile_decode.py``'s)."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        if name == "_module":  # (copy and pickle look attributes up before __init__ ran)
            raise AttributeError(name)
        function = getattr(self._module, name)
        if not callable(function) or name.startswith("__"):  # (__file__, __name__, ...)
            return function
        import torch

        label = f"minipaged_cpu::{name}"

        def run(*args, **kwargs):
            if not torch.autograd._profiler_enabled():  # (about 0.1 us: the hot path's case)
                return function(*args, **kwargs)
            with torch.profiler.record_function(label):
                return function(*args, **kwargs)

        setattr(self, name, run)  # (looked up once: the next call finds it on the instance)
        return run


def _float32(*tensors) -> bool:
    import torch

    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() >= 1
               for t in tensors)


def _int32(t):
    import torch

    return t.to(dtype=torch.int32).contiguous()


def _last_dim_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()
