"""Gemma 3 (text) as a diff of our LLaMA (lesson 08 loads models; this is one more family).

What transformers' Gemma3ForCausalLM does differently from LLaMA, and where it is here:

- every RMSNorm multiplies by ``1 + weight`` (the checkpoint stores the offset from 1) and
  rounds to the input's dtype only after that multiplication: ``GemmaRMSNorm``;
- a layer norms the attention's output and the MLP's output before adding them to the residual
  stream (four norms a layer, not two): ``Gemma3DecoderLayer``;
- the MLP is GeGLU, ``gelu_tanh(gate) * up`` (``LlamaMLP`` reads ``hidden_activation``);
- the embedding is scaled by sqrt(hidden_size), in the model's dtype: ``Gemma3ForCausalLM.embed``;
- queries are scaled by ``query_pre_attn_scalar ** -0.5`` and each head's query and key are
  normed (``LlamaAttention`` reads both from the config);
- five layers of six slide a window over the context and rotate with a base of 10,000, the
  sixth sees everything and rotates with 1,000,000 (``layer_types``, ``rope_parameters``
  keyed by layer type: ``model_shape.layer_windows``, ``rotary.rope_inv_freq``).

Refused, with a message naming them: attention logit soft-capping (Gemma 2's; the paged kernels
do not cap) and bidirectional attention (an encoder's).
"""
from __future__ import annotations

import torch
from torch import nn

from minipaged.kernels import ops
from minipaged.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class GemmaRMSNorm(nn.Module):
    """``rms_norm(x) * (1 + weight)`` in float32, then rounded to x's dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))  # 0: the identity scale
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., hidden) -> same
        one_plus = 1.0 + self.weight.float()
        return ops.rms_norm(x.float(), one_plus, self.eps).to(x.dtype)


class Gemma3DecoderLayer(LlamaDecoderLayer):
    norm_class = GemmaRMSNorm

    def __init__(self, config, layer_idx: int = 0) -> None:
        super().__init__(config, layer_idx)
        # Gemma's post_attention_layernorm norms the attention's output (LLaMA's norms the MLP's
        # input); the two around the MLP are new
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, kv_cache, meta) -> torch.Tensor:
        attended = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attended)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp_out)


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma3DecoderLayer

    def __init__(self, config) -> None:
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ValueError(f"attn_logit_softcapping={config.attn_logit_softcapping}: the paged "
                             "attention does not soft-cap its logits; minipaged refuses it")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True: minipaged runs causal decoders "
                             "only")
        super().__init__(config)
        self.embed_scale = config.hidden_size ** 0.5
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, hidden)
        hidden = self.embed_tokens(input_ids)
        # NOTE: the factor rounded to the model's dtype first, as transformers does (in bf16,
        # sqrt(640) = 25.298 becomes 25.25)
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)  # (R, vocab)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
