"""Copying a transformers checkpoint's tensors into our modules, with clear errors."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def load_checkpoint_weights(module: nn.Module, state_dict: dict[str, torch.Tensor],
                            rename: Callable[[str], str | None]) -> None:
    """Copy every checkpoint tensor into ``module``.

    ``rename`` maps a checkpoint name to ours, or to None for tensors we do not keep (a tied
    output layer, buffers of old checkpoints). Unknown names, wrong shapes and missing weights
    raise, so a checkpoint of another architecture never loads silently.

    Under tensor parallelism a parameter cuts its own shard out of the full tensor
    (``param.load_shard``, set by ``parallel_layers``); the shape check applies to the shard.
    """
    ours = module.state_dict()
    params = dict(module.named_parameters())
    loaded = set()
    for name, tensor in state_dict.items():
        key = rename(name)
        if key is None:
            continue
        if key not in ours:
            raise KeyError(f"unexpected weight {name!r} in the checkpoint")
        load_shard = getattr(params.get(key), "load_shard", None)
        if load_shard is not None:
            tensor = load_shard(tensor)
        if ours[key].shape != tensor.shape:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(ours[key].shape)}")
        ours[key].copy_(tensor)
        loaded.add(key)
    missing = set(ours) - loaded
    if missing:
        raise KeyError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")
