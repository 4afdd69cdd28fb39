"""GPT-2 with paged attention (lesson 06).

Same weights and arithmetic as transformers' GPT2LMHeadModel: learned position embeddings,
pre-LayerNorm blocks, fused q/k/v projection (``Conv1D`` weights stored as (in, out)), GELU MLP and
an output layer tied to the token embedding.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from minipaged.input_metadata import InputMetadata
from minipaged.models.attention import PagedAttention
from minipaged.models.weights import load_checkpoint_weights


class Conv1D(nn.Module):
    """A linear layer whose weight is stored (in, out), as in the GPT-2 checkpoints."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x, self.weight)  # (T, out)


class GPT2Attention(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_size = hidden // self.num_heads
        scale = self.head_size ** -0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        self.c_attn = Conv1D(hidden, 3 * hidden)
        self.c_proj = Conv1D(hidden, hidden)
        self.attn = PagedAttention(self.num_heads, self.head_size, scale)

    def forward(self, hidden, kv_cache, meta: InputMetadata) -> torch.Tensor:
        q, k, v = self.c_attn(hidden).chunk(3, dim=-1)  # 3 x (T, hidden)
        return self.c_proj(self.attn(q, k, v, kv_cache, meta))


class GPT2MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        inner = config.n_inner or 4 * config.hidden_size
        self.c_fc = Conv1D(config.hidden_size, inner)
        self.c_proj = Conv1D(inner, config.hidden_size)
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
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids, positions, kv_caches, meta: InputMetadata) -> torch.Tensor:
        hidden = self.wte(input_ids) + self.wpe(positions)  # (T, hidden)
        for i, block in enumerate(self.h):
            hidden = block(hidden, kv_caches[i] if kv_caches else None, meta)
        return self.ln_f(hidden)  # (T, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.wte.weight.t()  # (N, vocab): the output layer is tied to wte

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy weights from a transformers GPT2LMHeadModel state dict."""

        def rename(name: str) -> str | None:
            key = name.removeprefix("transformer.")
            if key == "lm_head.weight" or key.endswith((".attn.bias", ".attn.masked_bias")):
                return None  # tied output layer; causal-mask buffers of old checkpoints
            return key

        load_checkpoint_weights(self, state_dict, rename)
