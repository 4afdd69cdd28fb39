"""Tiny random checkpoints of the LLaMA-like families, saved with transformers (lesson 20;
``save_random`` saves any config, lessons 04 and 14).

Each is a real checkpoint directory (``config.json`` and ``model.safetensors``) that ``LLM(path)``
loads, with random weights: small enough to build in well under a second on a CPU. transformers
starts a norm's weight at 1 and a bias at 0; we add noise to every one-dimensional parameter, so
that a norm applied to the wrong numbers, or in the wrong order, changes the logits.
"""
from __future__ import annotations

import torch

VOCAB = 256  # token ids 0 .. 255; the checkpoints have no tokenizer (prompts are token ids)

# family -> (the transformers config class's name, settings on top of the common ones)
_FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "mistral": ("MistralConfig", dict(sliding_window=16)),
    # Gemma 3's pattern: five sliding layers, then one full layer
    "gemma3": ("Gemma3TextConfig", dict(
        num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}})),
}
FAMILIES = tuple(_FAMILIES)


def tiny_config(family: str, **overrides):
    """A transformers config of a tiny model of ``family``.

    Args:
        family: one of ``FAMILIES``.
        overrides: config fields to change (e.g. ``sliding_window=8``).
    """
    import transformers

    if family not in _FAMILIES:
        raise ValueError(f"unknown family {family!r}; tiny checkpoints exist for {FAMILIES}")
    class_name, settings = _FAMILIES[family]
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.3, bos_token_id=0, eos_token_id=1, pad_token_id=1,
                  tie_word_embeddings=False)
    fields.update(settings)
    fields.update(overrides)
    return getattr(transformers, class_name)(**fields)


def save_tiny(family: str, path, seed: int = 0, **overrides):
    """Build a random model of ``family``, save it to the folder ``path``, return it (eval mode).

    Args:
        family: one of ``FAMILIES``.
        path: an existing folder (a ``tempfile.TemporaryDirectory`` in the lesson).
        seed: the random weights' seed.
        overrides: config fields to change.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms' weights (and biases): away from their start values
                p.add_(torch.randn_like(p) * 0.3)
    model.generation_config.eos_token_id = None  # a fixed length: never stop early
    model.generation_config.pad_token_id = 1
    from transformers.utils import logging as hf_logging

    # A one-file checkpoint written in milliseconds: no "Writing model shards" bar in the lesson.
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return model


def save_random(config, prefix: str = "tiny_", seed: int = 0):
    """A ``tempfile.TemporaryDirectory`` holding a random model of ``config``, saved with
    transformers (lessons 04 and 14): ``LLM(folder.name)`` loads it.

    NOTE: keep the returned object while the folder is needed. It is removed by
    ``.cleanup()``, when it is garbage-collected, or when the kernel stops or restarts: no model is
    left behind in the temp folder, however far the lesson ran.

    Args:
        config: a transformers config (e.g. ``LlamaConfig(...)``).
        prefix: the folder name's start.
        seed: ``torch.manual_seed`` before the weights are drawn.
    """
    import tempfile

    from transformers import AutoModelForCausalLM

    folder = tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder.name)
    return folder


@torch.no_grad()
def greedy_tokens(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (token ids), ``max_new_tokens`` long.

    Args:
        model: a transformers causal LM (``save_tiny``'s).
        prompt: token ids.
        max_new_tokens: how many tokens to add.
    """
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=1)
    return out[0, len(prompt):].tolist()
