"""The first layers of a real model, without the rest: for lesson 07, which follows one layer.

Loading all 30 layers of SmolLM2-135M to look at the first one would spend most of the lesson's
time reading weights nobody looks at. ``load_first_layers`` builds our ``LlamaForCausalLM`` (or
GPT-2) with ``num_layers`` layers and reads only their tensors (and the embedding) from the
checkpoint's safetensors file.
"""
from __future__ import annotations

import copy
import glob
import os

import torch

from minipaged.model_shape import ModelShape
from minipaged.models.registry import get_model_class
from minipaged.worker import checkpoint


def _wanted(name: str, num_layers: int) -> bool:
    """Is the checkpoint tensor ``name`` part of the first ``num_layers`` layers or the edges?"""
    parts = name.split(".")
    if "layers" in parts or "h" in parts:  # model.layers.N.x (LLaMA), transformer.h.N.x (GPT-2)
        index = parts[(parts.index("layers") if "layers" in parts else parts.index("h")) + 1]
        return int(index) < num_layers
    return True  # embeddings, final norm, output layer


def load_first_layers(model: str | None = None, num_layers: int = 1):
    """(config, tokenizer, model) of ``model`` (None: the embedded SmolLM2-135M) cut to its first
    ``num_layers`` layers, weights read from the checkpoint, float32 on the CPU.

    Args:
        model: as for ``LLM(model)``; a directory with a ``.safetensors`` checkpoint.
        num_layers: how many layers to keep, at least 1.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be at least 1, got {num_layers}")
    source = checkpoint.resolve(model)
    config = copy.deepcopy(checkpoint.load_config(source))
    full = ModelShape.from_hf(config).num_layers
    if num_layers > full:
        raise ValueError(f"num_layers must be at most the model's {full} layers, got {num_layers}")
    config.num_hidden_layers = num_layers  # GPT2Config maps it to n_layer
    if getattr(config, "layer_types", None):  # (Qwen2, Qwen3, Gemma 3: one entry a layer)
        config.layer_types = list(config.layer_types[:num_layers])
    files = sorted(glob.glob(os.path.join(source, "*.safetensors")))
    if not files:
        raise ValueError(f"{source!r} has no .safetensors checkpoint to read layers from")
    from safetensors import safe_open

    state = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            state.update({name: f.get_tensor(name) for name in f.keys()
                          if _wanted(name, num_layers)})
    net = get_model_class(config)(config)
    net.load_weights(state)
    return config, checkpoint.load_tokenizer(source), net.eval()
