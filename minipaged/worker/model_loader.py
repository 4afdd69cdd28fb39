"""Building the model: its device, its dtype, its weights loaded, and the KV pool it leaves.

The checkpoint's files are found and read by ``checkpoint.py``; here they become our model on a
device (``build_model``), and a profiled forward pass says how much GPU memory is left for KV
blocks (``profile_num_gpu_blocks``, with ``gpu_memory.py``'s accounting). Used by
``LocalWorker`` (``worker.py``), in the engine's process or in each tensor-parallel worker
process (``mp_workers.py``, which builds its shard).
"""
from __future__ import annotations

import torch

from minipaged.worker import checkpoint
from minipaged.worker.gpu_memory import DeviceMemory, kv_pool_bytes
from minipaged.models.registry import get_model_class


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} needs a CUDA GPU and torch finds none here; use "
                         f"device='cpu' or 'auto'")
    return resolved


def resolve_dtype(dtype, config, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
             "half": torch.float16, "bfloat16": torch.bfloat16}
    if dtype in names:
        return names[dtype]
    if dtype != "auto":
        raise ValueError(f"dtype must be 'auto', 'float32', 'float16' or 'bfloat16', got {dtype!r}")
    if device.type != "cuda":
        return torch.float32  # half precision matmuls are slow or missing on CPUs
    config_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if config_dtype in (torch.bfloat16, "bfloat16"):
        return torch.bfloat16
    return torch.float16


def build_model(hf_config, source, load_format: str, dtype: torch.dtype,
                device: torch.device) -> torch.nn.Module:
    """Our model for ``hf_config`` on ``device``, weights from ``source`` or random ("dummy");
    "gguf" reads the GGUF file ``source``'s blocks as stored (``gguf_loader.py``).

    Under tensor parallelism (a worker, ``mp_workers.py``) this builds and loads the rank's shard.
    """
    model_class = get_model_class(hf_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(hf_config)
    finally:
        torch.set_default_dtype(previous)
    if load_format == "dummy":
        # Random weights (for benchmarks without a model hub), initialised on the device.
        std = getattr(hf_config, "initializer_range", 0.02)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0 if "norm" in name or "ln" in name else 0.0)
                else:
                    p.normal_(0.0, std)
    elif load_format == "auto":
        model.load_weights(checkpoint.load_state_dict(source))
    elif load_format == "gguf":  # (quantization="gguf": ``source`` is the GGUF file)
        from minipaged.worker.gguf_loader import load_gguf_weights

        load_gguf_weights(model, source, hf_config)
    else:
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    return model.eval()


@torch.inference_mode()
def profile_num_gpu_blocks(model, device: torch.device, num_tokens: int, max_len: int,
                           gpu_memory_utilization: float, block_bytes: int,
                           at_start: DeviceMemory) -> int:
    """Run the largest step the scheduler allows, without a cache, and see what is left.

    The pool gets ``gpu_memory_utilization`` of what this process could still take when the
    engine started (``at_start``, read before the weights loaded), less the engine's own peak:
    its weights and this step's activations (``gpu_memory.kv_pool_bytes``). Another engine
    alive in the same process is not counted as free. Under tensor parallelism each worker
    profiles its own GPU with its shard."""
    from minipaged.models.input_metadata import InputMetadata

    torch.cuda.reset_peak_memory_stats(device)
    prompt_lens = [max_len] * (num_tokens // max_len)
    if num_tokens % max_len:
        prompt_lens.append(num_tokens % max_len)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in prompt_lens])
    meta = InputMetadata(prompt_lens, torch.full((num_tokens,), -1, device=device),
                         torch.zeros(0, 0, dtype=torch.int32, device=device),
                         torch.zeros(0, dtype=torch.int32, device=device), 0)
    hidden = model(ids, positions, None, meta)
    model.compute_logits(hidden[-min(num_tokens, 256):])
    torch.cuda.synchronize(device)
    engine_peak = torch.cuda.max_memory_allocated(device) - at_start.allocated
    del hidden
    torch.cuda.empty_cache()  # the activations' blocks go back before the pool is allocated
    return kv_pool_bytes(at_start.available, gpu_memory_utilization, engine_peak) // block_bytes
