"""Execution: the KV cache tensors, the model runner, the sampler, loading models, tensor-parallel workers."""
