"""LLaMA (and SmolLM2) with paged attention (lesson 07 follows its first layer).

Same weights and arithmetic as transformers' LlamaForCausalLM: RMSNorm, grouped-query attention
with RoPE, a SwiGLU MLP, optionally tied input and output embeddings. The model works on a flat
batch of tokens (no batch dimension): see ``InputMetadata``.

Tensor parallel (lesson 14): each rank holds ``num_heads / N`` query heads and the
``num_kv_heads / N`` kv heads they read, so grouped-query attention stays inside the rank.
NOTE: N must divide the kv heads; we refuse otherwise rather than replicate kv heads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minipaged.kernels import ops
from minipaged.model_shape import ModelShape
from minipaged.models.input_metadata import InputMetadata
from minipaged.models.attention import PagedAttention
from minipaged.models.parallel_layers import (ColumnParallelLinear, FusedColumns,
                                              ParallelLMHead, RowParallelLinear,
                                              VocabParallelEmbedding, divide,
                                              get_tensor_parallel_state)
from minipaged.models.rotary import RotaryEmbedding
from minipaged.models.weights import load_checkpoint_weights


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # weight * (x * rsqrt(mean(x^2) + eps)), the norm in float32 as transformers computes it;
        # on a GPU one kernel of ours (csrc/layer_kernels.cu) where torch launches four
        return ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor):
        """``(self(x + residual), x + residual)``: on a GPU, the add and the norm in one kernel."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        world_size = get_tensor_parallel_state().world_size
        shape = ModelShape.from_hf(config)
        num_heads, num_kv_heads = shape.num_heads, shape.num_kv_heads  # of the whole model
        self.head_size = shape.head_size
        self.num_heads = divide(num_heads, world_size, "the attention heads")  # this rank's
        self.num_kv_heads = divide(num_kv_heads, world_size, "the key/value heads")
        bias = getattr(config, "attention_bias", False)
        hidden, D = config.hidden_size, self.head_size
        self.q_proj = ColumnParallelLinear(hidden, num_heads * D, bias=bias)
        self.k_proj = ColumnParallelLinear(hidden, num_kv_heads * D, bias=bias)
        self.v_proj = ColumnParallelLinear(hidden, num_kv_heads * D, bias=bias)
        self.o_proj = RowParallelLinear(num_heads * D, hidden, bias=bias)
        # The three read the same input: one matmul computes them (their weights share a tensor)
        self.qkv = FusedColumns(self.q_proj, self.k_proj, self.v_proj)
        self.rotary = RotaryEmbedding(config, self.head_size, shape.max_positions)
        self.attn = PagedAttention(self.num_heads, self.head_size, self.head_size ** -0.5,
                                   self.num_kv_heads)

    def forward(self, positions, hidden, kv_cache, meta: InputMetadata) -> torch.Tensor:
        T = hidden.shape[0]
        q, k, v = self.qkv(hidden)  # q_proj(hidden), k_proj(hidden), v_proj(hidden): one matmul
        q = q.view(T, self.num_heads, self.head_size)  # (T, H, D)
        k = k.view(T, self.num_kv_heads, self.head_size)  # (T, KVH, D)
        # v: (T, KVH * D)   (H, KVH: this rank's heads)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q.reshape(T, -1), k.reshape(T, -1), v, kv_cache, meta)  # (T, H * D)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        hidden, inner = config.hidden_size, ModelShape.from_hf(config).intermediate_size
        self.gate_proj = ColumnParallelLinear(hidden, inner, bias=bias)
        self.up_proj = ColumnParallelLinear(hidden, inner, bias=bias)
        self.down_proj = RowParallelLinear(inner, hidden, bias=bias)
        self.gate_up = FusedColumns(self.gate_proj, self.up_proj)  # one matmul for the two
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (LLaMA uses silu)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)  # gate_proj(x), up_proj(x): one matmul
        return self.down_proj(ops.silu_and_mul(gate, up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, positions, hidden, kv_cache, meta) -> torch.Tensor:
        attended = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta)
        # hidden + attended, and its norm for the MLP (one kernel on a GPU)
        normed, hidden = self.post_attention_layernorm.add_and_norm(attended, hidden)
        return hidden + self.mlp(normed)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config)
                                    for _ in range(ModelShape.from_hf(config).num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)

    def forward(self, input_ids, positions, kv_caches, meta: InputMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # (T, hidden)
        for i, layer in enumerate(self.layers):
            hidden = layer(positions, hidden, kv_caches[i] if kv_caches else None, meta)
        return self.norm(hidden)  # (T, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.tie_word_embeddings else self.lm_head
        return head.logits(hidden)  # (R, vocab)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy weights from a transformers LlamaForCausalLM state dict."""

        def rename(name: str) -> str | None:
            if "rotary_emb" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                return None  # computed, or tied to the embedding
            return name.removeprefix("model.")

        load_checkpoint_weights(self, state_dict, rename)
