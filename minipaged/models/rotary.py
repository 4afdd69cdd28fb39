"""Rotary position embeddings (RoPE) as LLaMA uses them, settings read from the HF config (lesson 07)."""
from __future__ import annotations

import torch
from torch import nn

from minipaged.kernels import ops


def rope_inv_freq(config, head_size: int,
                  layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scaling factor, from ``config.rope_parameters``.

    Args:
        config: the model's transformers config.
        head_size: elements per head (the rotated vector).
        layer_type: "sliding_attention" or "full_attention" for a model whose layer types have
            their own rope settings (Gemma 3: ``rope_parameters`` keyed by layer type).
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    per_type = layer_type is not None and isinstance(params.get(layer_type), dict)
    if per_type:
        params = dict(params[layer_type])
    if not params:  # older configs keep the settings flat
        params = {"rope_theta": getattr(config, "rope_theta", 10000.0), "rope_type": "default"}
        if getattr(config, "rope_scaling", None):
            params.update(config.rope_scaling)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params["rope_theta"]
        exponents = torch.arange(0, head_size, 2, dtype=torch.float) / head_size
        return 1.0 / (base ** exponents), 1.0
    # Scaled variants (linear, dynamic, yarn, llama3, ...): transformers implements the formulas;
    # we use its functions so that the numbers match the reference exactly.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r} in the model config")
    if rope_type == "dynamic":
        raise ValueError("rope_type 'dynamic' changes with sequence length; not supported")
    by_type = {"layer_type": layer_type} if per_type else {}
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **by_type)
    return inv_freq.float(), float(attention_scaling)


class RotaryEmbedding(nn.Module):
    """Rotates query and key vectors by their position (rotate-half layout, as in HF LLaMA).

    Its cos/sin tables hold ``max_position`` rows when built; ``fit_positions`` cuts them to the
    positions an engine can use (its ``max_model_len``)."""

    def __init__(self, config, head_size: int, max_position: int,
                 layer_type: str | None = None) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(config, head_size, layer_type)  # (D/2,)
        self.max_position = max_position
        self.scaling = scaling
        self.inv_freq = inv_freq  # (kept for tables longer than the fitted ones)
        cos, sin = self._tables(max_position)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def _tables(self, num_positions: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(num_positions, dtype=torch.float, device=device)  # (P,)
        freqs = positions[:, None] * self.inv_freq[None, :].to(positions.device)  # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
        return emb.cos() * self.scaling, emb.sin() * self.scaling

    @property
    def num_positions(self) -> int:
        """The positions its tables hold now."""
        return self.cos_cache.shape[0]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # q: (T, H, D), k: (T, KVH, D), positions: (T,)
        if self.cos_cache.dtype != q.dtype:
            # once: rounding the table, then gathering, gives the same numbers as gathering, then
            # rounding, without a cast per layer and step
            self.cos_cache = self.cos_cache.to(q.dtype)
            self.sin_cache = self.sin_cache.to(q.dtype)
        # q * cos + rotate_half(q) * sin, and the same for k (kernels/reference.py); on a GPU one
        # kernel of ours where torch launches twelve
        return ops.rotary(positions, q, k, self.cos_cache, self.sin_cache)


def share_tables(model: nn.Module) -> None:
    """Rotary layers whose tables are equal hold one copy of them: SmolLM2's 30 layers held
    30 equal tables of 8,192 positions, 126 MB in all, where one takes 4 MB. A model built on the
    meta device (shapes only) has no values to compare: nothing is shared."""
    kept: list[RotaryEmbedding] = []
    for module in model.modules():
        if not isinstance(module, RotaryEmbedding) or module.cos_cache.is_meta:
            continue
        for first in kept:
            if (first.cos_cache.shape == module.cos_cache.shape
                    and torch.equal(first.cos_cache, module.cos_cache)
                    and torch.equal(first.sin_cache, module.sin_cache)):
                module.cos_cache, module.sin_cache = first.cos_cache, first.sin_cache
                break
        else:
            kept.append(module)


def fit_positions(model: nn.Module, num_positions: int) -> None:
    """Every rotary table of ``model`` holds ``num_positions`` rows (at most its model's
    ``max_position``): the engine's ``max_model_len``, the positions it can use. Gemma 3 270M's
    two tables of 32,768 positions (head size 256, float32) took 134 MB for a model whose weights
    take 241 MB as stored. A shorter table is the first rows of the longer one, copied (so that the
    longer one's memory goes back); a longer one is computed again. Tables shared between layers
    stay shared."""
    fitted: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id of a table -> its new pair
    for module in model.modules():
        if not isinstance(module, RotaryEmbedding) or module.cos_cache.is_meta:
            continue
        key = id(module.cos_cache)
        if key not in fitted:
            n = max(1, min(num_positions, module.max_position))
            cos, sin = module.cos_cache, module.sin_cache
            if n < cos.shape[0]:
                cos, sin = cos[:n].clone(), sin[:n].clone()
            elif n > cos.shape[0]:
                cos, sin = module._tables(n, cos.device)
                cos, sin = cos.to(module.cos_cache.dtype), sin.to(module.sin_cache.dtype)
            fitted[key] = cos, sin
        module.cos_cache, module.sin_cache = fitted[key]
