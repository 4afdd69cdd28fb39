"""A model's shape, read from its Hugging Face config in one place, and what its KV cache costs
(lesson 01 counts the bytes; lesson 15 the weights a step reads).

The engine, the models, the draft proposer, the tensor-parallel check and the cost models of
``lab/`` all read the numbers here, so that GPT-2's names (``n_head``, ``n_embd``) and LLaMA's
(``num_key_value_heads``, ``head_dim``) are told apart once:

    KV bytes per token = 2 (K and V) x layers x kv_heads x head_size x bytes per element
"""
from __future__ import annotations

from dataclasses import dataclass


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_size: int,
                       element_size: int) -> int:
    """KV cache bytes one token occupies: a key and a value vector per kv head, per layer.

    Args:
        num_layers: the model's layers (each keeps its own K and V).
        num_kv_heads: the key/value heads (fewer than the query heads under grouped-query
            attention); per rank under tensor parallel.
        head_size: elements of one head's key (and value) vector.
        element_size: bytes of one element (4 for float32, 2 for float16 and bfloat16).
    """
    return 2 * num_layers * num_kv_heads * head_size * element_size


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only model (GPT-2 or LLaMA) that the engine and the cost
    models need."""

    num_layers: int
    hidden_size: int
    intermediate_size: int  # the MLP's width
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads: num_heads, or fewer under grouped-query attention
    head_size: int
    vocab_size: int
    max_positions: int  # the longest sequence the model was trained for
    gated_mlp: bool  # LLaMA's MLP has three matrices (gate, up, down); GPT-2's two

    @classmethod
    def from_hf(cls, hf_config) -> ModelShape:
        """The shape of a transformers ``GPT2Config`` or ``LlamaConfig``.

        NOTE: GPT2Config answers to the common names (``num_attention_heads`` is its
        ``n_head``, ``hidden_size`` its ``n_embd``) but has no ``intermediate_size``: its MLP is
        ``n_inner`` wide, or 4 x hidden when that is None. A LLaMA config without
        ``num_key_value_heads`` or ``head_dim`` has one kv head per head and
        ``hidden_size / heads`` elements per head.

        Args:
            hf_config: the model's transformers config.
        """
        heads = hf_config.num_attention_heads
        hidden = hf_config.hidden_size
        gpt2 = hf_config.model_type == "gpt2"
        width = (getattr(hf_config, "n_inner", None) if gpt2
                 else getattr(hf_config, "intermediate_size", None))
        return cls(num_layers=hf_config.num_hidden_layers, hidden_size=hidden,
                   intermediate_size=width or 4 * hidden, num_heads=heads,
                   num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
                   head_size=getattr(hf_config, "head_dim", None) or hidden // heads,
                   vocab_size=hf_config.vocab_size,
                   max_positions=hf_config.max_position_embeddings, gated_mlp=not gpt2)

    def kv_bytes_per_token(self, element_size: int, world_size: int = 1) -> int:
        """KV cache bytes of one token (per rank: each of ``world_size`` ranks holds
        ``num_kv_heads / world_size`` heads).

        Args:
            element_size: bytes of one element of the cache.
            world_size: the tensor-parallel ranks the kv heads are split over.
        """
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads // world_size,
                                  self.head_size, element_size)

    @property
    def weight_params(self) -> int:
        """Weights a step reads: every layer's q, k, v, o and MLP matrices, and the LM head."""
        h = self.hidden_size
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        attention = h * q + 2 * h * kv + q * h
        mlp = (3 if self.gated_mlp else 2) * h * self.intermediate_size
        return self.num_layers * (attention + mlp) + self.vocab_size * h
