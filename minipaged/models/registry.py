"""Our model implementations, picked by the checkpoint's ``model_type`` (lesson 08)."""
from __future__ import annotations

from torch import nn

from minipaged.models.gpt2 import GPT2LMHeadModel
from minipaged.models.llama import LlamaForCausalLM

MODEL_CLASSES = {
    "gpt2": GPT2LMHeadModel,
    "llama": LlamaForCausalLM,
}


def get_model_class(config) -> type[nn.Module]:
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_CLASSES:
        raise ValueError(f"model_type {model_type!r} is not supported; minipaged implements "
                         f"{sorted(MODEL_CLASSES)}")
    return MODEL_CLASSES[model_type]
