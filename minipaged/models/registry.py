"""Our model implementations, picked by the checkpoint's ``model_type`` (lesson 08).

Qwen2, Qwen3 and Mistral are LLaMA with a few lines that read the config (``llama.py``);
Gemma 3 needs a file of its own (``gemma3.py``).
"""
from __future__ import annotations

from torch import nn

from minipaged.model_shape import layer_windows
from minipaged.models.gemma3 import Gemma3ForCausalLM
from minipaged.models.gpt2 import GPT2LMHeadModel
from minipaged.models.llama import LlamaForCausalLM

MODEL_CLASSES = {
    "gpt2": GPT2LMHeadModel,
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,  # + a bias on q, k, v
    "qwen3": LlamaForCausalLM,  # + a per-head RMSNorm on q and k
    "mistral": LlamaForCausalLM,  # + a sliding window
    "gemma3_text": Gemma3ForCausalLM,
}


def get_model_class(config) -> type[nn.Module]:
    """Our class for the checkpoint's config; a family or layout we do not implement raises a
    ValueError naming it.

    Args:
        config: the model's transformers config.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_CLASSES:
        hint = (" (the multimodal Gemma 3; minipaged runs its text model, 'gemma3_text')"
                if model_type == "gemma3" else "")
        raise ValueError(f"model_type {model_type!r} is not supported{hint}; minipaged "
                         f"implements {sorted(MODEL_CLASSES)}")
    layer_windows(config)  # a window layout we cannot run is refused here, before any weight
    return MODEL_CLASSES[model_type]
