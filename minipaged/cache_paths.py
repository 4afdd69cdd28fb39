"""Where minipaged keeps what it makes on disk: one folder, one variable (lessons 05 and 07).

Everything minipaged writes outside the working tree lives under one root:

- ``torch_ext/``: the compiled C++ and CUDA ops, one folder per build (``kernels/build.py``);
- ``torch_ext/sanitize/``: the sanitizer programs of the CUDA kernels built for the CPU;
- the embedded model converted from GGUF to safetensors (``worker/checkpoint.py``);
- ``gguf/`` and ``gemma-3-270m/``: Gemma 3 270M's GGUF file assembled from its package's
  chunks, and its safetensors copy (``worker/checkpoint.py``);
- ``gguf-converted/`` and ``gguf-metadata/``: a ``.gguf`` file given as the model, converted
  to safetensors, or only its config and tokenizer for ``quantization="gguf"``, one folder per
  file (``worker/checkpoint.py``).

The root is ``~/.cache/minipaged`` unless ``$MINIPAGED_CACHE`` names another folder (tests point
it at a temporary folder so that they never touch the user's cache).
"""
from __future__ import annotations

import os
from pathlib import Path

CACHE_VARIABLE = "MINIPAGED_CACHE"


def cache_root() -> Path:
    """The one folder minipaged caches things in (read from the environment at every call)."""
    return Path(os.environ.get(CACHE_VARIABLE) or Path.home() / ".cache" / "minipaged")


def extensions_root() -> Path:
    """The folder of the compiled ops, one sub-folder per build."""
    return cache_root() / "torch_ext"
