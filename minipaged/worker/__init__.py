"""Execution behind one ``Worker`` interface: the KV cache tensors, the model runner, the
sampler, reading checkpoints and building models, the tensor-parallel worker processes."""
