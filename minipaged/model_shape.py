"""A model's shape, read from its Hugging Face config in one place, and what its KV cache costs
(lesson 01 counts the bytes; lesson 15 the weights a step reads).

The engine, the models, the draft proposer, the tensor-parallel check and the cost models of
``lab/`` all read the numbers here, so that GPT-2's names (``n_head``, ``n_embd``) and LLaMA's
(``num_key_value_heads``, ``head_dim``) are told apart once:

    KV bytes per token = 2 (K and V) x layers x kv_heads x head_size x bytes per element
"""
from __future__ import annotations

from dataclasses import dataclass, field

# The families whose checkpoints name each layer's attention "sliding_attention" or
# "full_attention" in ``layer_types`` (Mistral slides every layer by ``sliding_window``).
_LAYER_TYPE_FAMILIES = ("qwen2", "qwen3", "gemma3_text")


def layer_windows(hf_config) -> tuple[int | None, ...]:
    """Each layer's sliding window in tokens, or None for a layer that sees the whole context.

    A layer with window W lets the token at position p attend to positions p - W + 1 ... p (the
    W newest, itself included), as transformers' sliding masks do. Refuses, naming what is
    wrong, a layer type we do not implement and a window that is not a positive integer.

    Args:
        hf_config: the model's transformers config.
    """
    num_layers = hf_config.num_hidden_layers
    model_type = getattr(hf_config, "model_type", None)
    window = getattr(hf_config, "sliding_window", None)
    if model_type == "mistral":
        types = ["sliding_attention" if window is not None else "full_attention"] * num_layers
    elif model_type in _LAYER_TYPE_FAMILIES:
        types = list(getattr(hf_config, "layer_types", None) or ["full_attention"] * num_layers)
    else:  # GPT-2, LLaMA: no window
        return (None,) * num_layers
    if len(types) != num_layers:
        raise ValueError(f"layer_types names {len(types)} layers, the model has {num_layers}")
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"layer_types holds {unknown}: minipaged implements only "
                         "'sliding_attention' and 'full_attention' layers")
    if "sliding_attention" in types and (not isinstance(window, int) or isinstance(window, bool)
                                         or window < 1):
        raise ValueError(f"sliding_window must be a positive number of tokens for the sliding "
                         f"layers, got {window!r}")
    return tuple(window if t == "sliding_attention" else None for t in types)


@dataclass(frozen=True)
class KVGroup:
    """Layers whose KV cache one block table serves: one attention kind (their window, None
    for full attention), ``layers`` their indices."""

    window: int | None
    layers: tuple[int, ...]


def kv_groups(windows: tuple) -> tuple[KVGroup, ...]:
    """The KV cache groups of a model whose layers have these windows (lesson 20): the layers
    of one window, cut into groups of equal size, full-attention groups first.

    Every group has as many layers as the kind with the fewest, so that a block of any group is
    the same bytes and all groups draw from one pool (vLLM's hybrid KV cache manager does the
    same): Gemma 3 270M's 15 sliding and 3 full layers make one full group and five sliding
    groups of 3 layers; the tiny Gemma 3's 5 and 1 make six groups of one layer. The last
    group of a kind may have fewer layers (its blocks keep the missing layers' room unused).
    A model with one kind of layer is one group.

    Args:
        windows: each layer's sliding window, None for full attention (``layer_windows``).
    """
    by_window: dict = {}
    for layer, window in enumerate(windows):
        by_window.setdefault(window, []).append(layer)
    if not by_window:
        return ()
    size = min(len(layers) for layers in by_window.values())
    groups = []
    for window in sorted(by_window, key=lambda w: (w is not None, w or 0)):
        layers = by_window[window]
        groups += [KVGroup(window, tuple(layers[i:i + size]))
                   for i in range(0, len(layers), size)]
    return tuple(groups)


def layer_kv_groups(windows: tuple) -> tuple[tuple[int, int], ...]:
    """Per layer: (its KV cache group's index in ``kv_groups``, its place in that group).

    The place is the layer's cache tensor in a hybrid cache: the i-th layer of every group
    shares one tensor, each block of it used by the group that holds the block.

    Args:
        windows: each layer's sliding window (``layer_windows``).
    """
    where = {}
    for g, group in enumerate(kv_groups(windows)):
        for place, layer in enumerate(group.layers):
            where[layer] = (g, place)
    return tuple(where[layer] for layer in range(len(windows)))


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_size: int,
                       element_size: int, scale_bytes: int = 0) -> int:
    """KV cache bytes one token occupies: a key and a value vector per kv head, per layer.

    Args:
        num_layers: the model's layers (each keeps its own K and V).
        num_kv_heads: the key/value heads (fewer than the query heads under grouped-query
            attention); per rank under tensor parallel.
        head_size: elements of one head's key (and value) vector.
        element_size: bytes of one element (4 for float32, 2 for float16 and bfloat16, 1 for
            an 8-bit cache).
        scale_bytes: bytes of the scale stored with each vector (4 for an 8-bit cache's
            float32 scale, lesson 18; 0 otherwise).
    """
    return 2 * num_layers * num_kv_heads * (head_size * element_size + scale_bytes)


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
    # each layer's sliding window, None for full attention (layer_windows); not part of equality,
    # so a shape written by hand (lessons, cost models) equals the one read from a config
    windows: tuple = field(default=(), compare=False)

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
                   max_positions=hf_config.max_position_embeddings, gated_mlp=not gpt2,
                   windows=layer_windows(hf_config))

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer slides by the same window, else None: only then may a
        sequence's blocks that left the window go back to the free list (every layer has
        stopped reading them)."""
        windows = set(self.windows)
        if len(windows) == 1 and None not in windows:
            return windows.pop()
        return None

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
