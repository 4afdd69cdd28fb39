"""LLaMA (and SmolLM2) with paged attention (lesson 07 follows its first layer), and the families
that are small diffs of it: Qwen2, Qwen3, Mistral (and Gemma 3, ``gemma3.py``).

Same weights and arithmetic as transformers' LlamaForCausalLM: RMSNorm, grouped-query attention
with RoPE, a SwiGLU MLP, optionally tied input and output embeddings. The model works on a flat
batch of tokens (no batch dimension): see ``InputMetadata``. Where a family differs, one line
here says so, read from the checkpoint's config:

- Qwen2: a bias on q, k and v (not on o);
- Qwen3: an RMSNorm over each head's query and key, before the rotation;
- Mistral, and the sliding layers of Qwen2/Qwen3/Gemma 3: the attention sees only the
  ``sliding_window`` newest tokens (``model_shape.layer_windows``).

Tensor parallel (lesson 14): each rank holds ``num_heads / N`` query heads and the
``num_kv_heads / N`` kv heads they read, so grouped-query attention stays inside the rank.
NOTE: N must divide the kv heads; we refuse otherwise rather than replicate kv heads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minipaged.kernels import ops
from minipaged.model_shape import ModelShape, layer_kv_groups
from minipaged.models.input_metadata import InputMetadata
from minipaged.models.attention import PagedAttention
from minipaged.models.parallel_layers import (ColumnParallelLinear, FusedColumns,
                                              ParallelLMHead, RowParallelLinear,
                                              VocabParallelEmbedding, divide,
                                              get_tensor_parallel_state)
from minipaged.models.rotary import RotaryEmbedding, share_tables
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


def hidden_activation(config) -> str:
    """The MLP's activation (Gemma names it ``hidden_activation``, the others ``hidden_act``)."""
    return getattr(config, "hidden_activation", None) or config.hidden_act


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int = 0, norm_class=RMSNorm) -> None:
        super().__init__()
        world_size = get_tensor_parallel_state().world_size
        shape = ModelShape.from_hf(config)
        num_heads, num_kv_heads = shape.num_heads, shape.num_kv_heads  # of the whole model
        self.head_size = shape.head_size
        self.num_heads = divide(num_heads, world_size, "the attention heads")  # this rank's
        self.num_kv_heads = divide(num_kv_heads, world_size, "the key/value heads")
        bias = getattr(config, "attention_bias", False)
        qkv_bias = bias or config.model_type == "qwen2"  # Qwen2: q, k and v biased, o not
        hidden, D = config.hidden_size, self.head_size
        self.q_proj = ColumnParallelLinear(hidden, num_heads * D, bias=qkv_bias)
        self.k_proj = ColumnParallelLinear(hidden, num_kv_heads * D, bias=qkv_bias)
        self.v_proj = ColumnParallelLinear(hidden, num_kv_heads * D, bias=qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * D, hidden, bias=bias)
        # The three read the same input: one matmul computes them (their weights share a tensor)
        self.qkv = FusedColumns(self.q_proj, self.k_proj, self.v_proj)
        # Qwen3 and Gemma 3: each head's query and key normed (one weight of D, shared by heads)
        self.qk_norm = config.model_type in ("qwen3", "gemma3_text")
        if self.qk_norm:
            self.q_norm = norm_class(D, config.rms_norm_eps)
            self.k_norm = norm_class(D, config.rms_norm_eps)
        window = shape.windows[layer_idx]  # None: this layer sees the whole context
        # Gemma 3's sliding and full layers rotate with their own bases
        layer_type = getattr(config, "layer_types", None)
        layer_type = layer_type[layer_idx] if layer_type else None
        self.rotary = RotaryEmbedding(config, self.head_size, shape.max_positions, layer_type)
        # Gemma 3 scales its queries by query_pre_attn_scalar, not by the head size
        scale = getattr(config, "query_pre_attn_scalar", None) or self.head_size
        # (the window passed only when there is one: lesson 07's build track plugs in the
        # learner's attention class, which need not take it)
        windowed = {} if window is None else {"sliding_window": window}
        self.attn = PagedAttention(self.num_heads, self.head_size, scale ** -0.5,
                                   self.num_kv_heads, **windowed)
        # a hybrid cache (lesson 20) gives each KV cache group its own block tables and slots;
        # the worker sets grouped_cache when the cache's layers share tensors by group
        self.kv_group = layer_kv_groups(shape.windows)[layer_idx][0]
        self.grouped_cache = False

    def forward(self, positions, hidden, kv_cache, meta: InputMetadata) -> torch.Tensor:
        T = hidden.shape[0]
        q, k, v = self.qkv(hidden)  # q_proj(hidden), k_proj(hidden), v_proj(hidden): one matmul
        q = q.view(T, self.num_heads, self.head_size)  # (T, H, D)
        k = k.view(T, self.num_kv_heads, self.head_size)  # (T, KVH, D)
        # v: (T, KVH * D)   (H, KVH: this rank's heads)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)  # over each head's D elements
        q, k = self.rotary(positions, q, k)
        if self.grouped_cache and meta.group_metas is None and kv_cache is not None:
            # NOTE: one table for every layer would write the groups' K/V over each other
            raise ValueError("this cache has KV cache groups (kv_cache_groups): the step's "
                             "InputMetadata needs each group's slots and tables, group_metas "
                             "(prepare_inputs builds them from the SequenceRuns)")
        if self.kv_group:  # (a hybrid model's later KV cache groups)
            meta = meta.for_group(self.kv_group)
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
        self.act = hidden_activation(config)
        if self.act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported hidden activation {self.act!r}: minipaged implements "
                             "'silu' (LLaMA, Qwen, Mistral) and 'gelu_pytorch_tanh' (Gemma)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)  # gate_proj(x), up_proj(x): one matmul
        if self.act == "gelu_pytorch_tanh":  # Gemma's GeGLU
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return self.down_proj(ops.silu_and_mul(gate, up))


class LlamaDecoderLayer(nn.Module):
    norm_class = RMSNorm  # Gemma 3's layer uses its own (gemma3.py)

    def __init__(self, config, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, self.norm_class)
        self.post_attention_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, positions, hidden, kv_cache, meta) -> torch.Tensor:
        attended = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta)
        # hidden + attended, and its norm for the MLP (one kernel on a GPU)
        normed, hidden = self.post_attention_layernorm.add_and_norm(attended, hidden)
        return hidden + self.mlp(normed)


class LlamaForCausalLM(nn.Module):
    layer_class = LlamaDecoderLayer  # Gemma 3: Gemma3DecoderLayer (gemma3.py)

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(config, i)
                                    for i in range(ModelShape.from_hf(config).num_layers))
        self.norm = self.layer_class.norm_class(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        share_tables(self)  # (the layers' equal rotary tables: one copy)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, hidden)
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, kv_caches, meta: InputMetadata) -> torch.Tensor:
        hidden = self.embed(input_ids)  # (T, hidden)
        for i, layer in enumerate(self.layers):
            hidden = layer(positions, hidden, kv_caches[i] if kv_caches else None, meta)
        return self.norm(hidden)  # (T, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.tie_word_embeddings else self.lm_head
        return head.logits(hidden)  # (R, vocab)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy weights from a transformers state dict (LlamaForCausalLM, or the family's)."""

        def rename(name: str) -> str | None:
            if "rotary_emb" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                return None  # computed, or tied to the embedding
            return name.removeprefix("model.")

        load_checkpoint_weights(self, state_dict, rename)
