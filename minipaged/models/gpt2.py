"""GPT-2 with paged attention (lesson 07 compares it with LLaMA).

Same weights and arithmetic as transformers' GPT2LMHeadModel: learned position embeddings,
pre-LayerNorm blocks, fused q/k/v projection (``Conv1D`` weights stored as (in, out)), GELU MLP and
an output layer tied to the token embedding.

Tensor parallel (lesson 14): each rank holds ``n_head / N`` heads. The fused ``c_attn`` is
[q | k | v] along its output columns, so each of the three is split per head on its own.
"""
from __future__ import annotations

import torch
from torch import nn

from minipaged.model_shape import ModelShape
from minipaged.models.input_metadata import InputMetadata
from minipaged.models.attention import PagedAttention
from minipaged.models.parallel_layers import (ColumnParallelLinear, RowParallelLinear,
                                              VocabParallelEmbedding, divide,
                                              get_tensor_parallel_state)
from minipaged.models.weights import load_checkpoint_weights


class GPT2Attention(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        shape = ModelShape.from_hf(config)
        hidden = shape.hidden_size
        world_size = get_tensor_parallel_state().world_size
        self.num_heads = divide(shape.num_heads, world_size, "the attention heads")  # this rank's
        self.head_size = shape.head_size
        scale = self.head_size ** -0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        # Conv1D layout: weights stored (in, out). This rank's heads of q, k and v; then its
        # heads' rows of the output projection, summed over ranks by an all-reduce.
        self.c_attn = ColumnParallelLinear(hidden, 3 * hidden, fused=[hidden] * 3,
                                           transposed=True)
        self.c_proj = RowParallelLinear(hidden, hidden, transposed=True)
        self.attn = PagedAttention(self.num_heads, self.head_size, scale)

    def forward(self, hidden, kv_cache, meta: InputMetadata) -> torch.Tensor:
        q, k, v = self.c_attn(hidden).chunk(3, dim=-1)  # 3 x (T, hidden / N)
        return self.c_proj(self.attn(q, k, v, kv_cache, meta))


class GPT2MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        inner = ModelShape.from_hf(config).intermediate_size  # n_inner, or 4 x hidden
        self.c_fc = ColumnParallelLinear(config.hidden_size, inner, transposed=True)
        self.c_proj = RowParallelLinear(inner, config.hidden_size, transposed=True)
        from transformers.activations import ACT2FN  # here: a slow import LLaMA does not need

        self.act = ACT2FN[config.activation_function]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = GPT2MLP(config)

    def forward(self, hidden, kv_cache, meta) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden), kv_cache, meta)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2LMHeadModel(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        shape = ModelShape.from_hf(config)
        self.wpe = nn.Embedding(shape.max_positions, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(shape.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids, positions, kv_caches, meta: InputMetadata) -> torch.Tensor:
        hidden = self.wte(input_ids) + self.wpe(positions)  # (T, hidden)
        for i, block in enumerate(self.h):
            hidden = block(hidden, kv_caches[i] if kv_caches else None, meta)
        return self.ln_f(hidden)  # (T, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.wte.logits(hidden)  # (R, vocab): the output layer is tied to wte

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy weights from a transformers GPT2LMHeadModel state dict."""

        def rename(name: str) -> str | None:
            key = name.removeprefix("transformer.")
            if key == "lm_head.weight" or key.endswith((".attn.bias", ".attn.masked_bias")):
                return None  # tied output layer; causal-mask buffers of old checkpoints
            return key

        load_checkpoint_weights(self, state_dict, rename)
