"""A LLaMA or Gemma 3 GGUF file's weights loaded as the file stores them (``quantization="gguf"``).

``load_gguf_weights`` reads the file with the ``gguf`` package's reader and puts each matrix into
our model as a ``GGUFWeight`` (``models/gguf_linear.py``): its rows of blocks, never float32.
Norms (float32 in the file) are copied into their parameters as usual. What transformers' GGUF
loader does to the values is done here too, so that the weights are the ones the float32 path
(the file converted by transformers, ``checkpoint.py``) holds:

- llama.cpp's converter reorders the rows of q and k (each head's rotary pairs interleaved);
  transformers puts them back (``reverse_permute_weights``). A permutation of rows moves whole
  rows of blocks, so it is applied to the blocks, exactly (``_unpermute``).

Every tensor's format is checked before any weight is loaded: a format minipaged does not read
raises a ValueError naming the tensor, its format and the formats minipaged reads.
"""
from __future__ import annotations

import numpy as np
import torch

from minipaged.kernels import build
from minipaged.kernels.gguf_blocks import UNQUANTIZED, block_format
from minipaged.models.gguf_linear import GGUFWeight, choose_routine
from minipaged.models.parallel_layers import FusedColumns
from minipaged.worker.gguf_file import read_gguf

_LAYER_NAMES = {  # blk.N.<gguf name> -> layers.N.<our name>
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_NAMES = {  # Gemma 3's own (its ffn_norm is the norm before the MLP, as LLaMA's)
    **_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
# architecture -> (its layers' names, q/k rows in llama.cpp's order, norms stored as 1 + weight)
_ARCHITECTURES = {"llama": (_LAYER_NAMES, True, False), "gemma3": (_GEMMA3_NAMES, False, True)}
ARCHITECTURES = tuple(_ARCHITECTURES)


def our_name(gguf_name: str, arch: str = "llama") -> str:
    """``blk.3.attn_q.weight`` -> ``layers.3.self_attn.q_proj.weight`` (our module's names)."""
    stem, _, kind = gguf_name.rpartition(".")
    layer_names = _ARCHITECTURES[arch][0]
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part in layer_names:
            return f"layers.{layer}.{layer_names[part]}.{kind}"
    elif stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{kind}"
    raise KeyError(f"unexpected tensor {gguf_name!r} in the GGUF file")


def open_checked(path: str):
    """The file's reader, once its architecture and every tensor's format are known to be ones
    minipaged reads (else a ValueError, before any weight is loaded)."""
    reader = read_gguf(path)
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in ARCHITECTURES:
        raise ValueError(f"quantization='gguf' reads {', '.join(ARCHITECTURES)} GGUF files; "
                         f"{path} holds {arch!r}")
    for t in reader.tensors:
        if t.tensor_type.name not in UNQUANTIZED:
            try:
                block_format(t.tensor_type.name)
            except ValueError as e:
                raise ValueError(f"{path}: tensor {t.name!r}: {e}") from None
    return reader


def _unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' reverse of llama.cpp's q/k row order, applied to whole rows."""
    order = torch.arange(rows.shape[0]).reshape(heads, -1, 2).transpose(1, 2).reshape(-1)
    return rows.index_select(0, order)


def load_gguf_weights(model: torch.nn.Module, path: str, hf_config) -> None:
    """Load ``path``'s tensors into ``model`` (a freshly built LLaMA), matrices as blocks."""
    reader = open_checked(path)
    arch = reader.fields["general.architecture"].contents()
    _, permuted, one_plus = _ARCHITECTURES[arch]
    modules = dict(model.named_modules())
    device = next(model.parameters()).device
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    loaded = set()
    for t in reader.tensors:
        name = our_name(t.name, arch)
        if name == "lm_head.weight" and getattr(model, "tie_word_embeddings", False):
            continue
        module_name, _, kind = name.rpartition(".")
        module = modules.get(module_name)
        if module is None or not hasattr(module, kind):
            raise KeyError(f"unexpected weight {t.name!r} in the GGUF file")
        rows = torch.from_numpy(np.array(t.data))  # (a copy: the file's map is let go)
        if permuted and (".attn_q." in t.name or ".attn_k." in t.name):
            rows = _unpermute(rows, heads if ".attn_q." in t.name else kv_heads)
        if t.tensor_type.name in UNQUANTIZED:
            values = rows.float()
            if one_plus and name.endswith("norm.weight"):
                values = values - 1  # (transformers' Gemma processor: the offset from 1)
            _copy_into(getattr(module, kind), values, t.name)
        else:
            weight = GGUFWeight(rows.to(device), block_format(t.tensor_type.name),
                                getattr(module, kind).dtype)
            expected = tuple(getattr(module, kind).shape)
            if tuple(weight.shape) != expected:
                raise ValueError(f"weight {t.name!r} has shape {tuple(weight.shape)}, "
                                 f"expected {expected}")
            delattr(module, kind)  # the float parameter goes; the blocks take its place
            setattr(module, kind, weight)
        loaded.add(name)
    missing = {n for n, _ in model.named_parameters()} - loaded
    if missing:
        raise KeyError(f"weights missing from the GGUF file: {sorted(missing)[:5]}")
    for module in model.modules():
        if isinstance(module, FusedColumns):
            _fuse(module)
    if device.type == "cpu":
        build.CPU_OP.load()  # (the routines are chosen with the C++ op where it can be built)
    for w in quantized_weights(model):
        choose_routine(w)


def _copy_into(param: torch.Tensor, rows: torch.Tensor, name: str) -> None:
    values = rows.float().reshape(param.shape) if rows.numel() == param.numel() else None
    if values is None:
        raise ValueError(f"weight {name!r} has shape {tuple(rows.shape)}, expected "
                         f"{tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(values)


def _fuse(fused: FusedColumns) -> None:
    """q/k/v (gate/up) as one weight of blocks, each linear's weight a view of its rows."""
    parts = [l.weight for l in fused.linears]
    if not all(isinstance(p, GGUFWeight) for p in parts):
        return  # (float matrices in the file: the fused float tensor stays)
    if len({p.fmt.name for p in parts}) > 1:  # (Gemma 3's Q5_0 q and k, Q8_0 v): one by one,
        fused.weight = None  # and the float tensor made for the fusion let go
        return
    whole = GGUFWeight.cat(parts)
    fused.use_weights(whole, whole.split_rows(fused.sizes))


def quantized_weights(model: torch.nn.Module) -> list[GGUFWeight]:
    """Every ``GGUFWeight`` of ``model``, each once (a fused one, not its views)."""
    found, seen = [], set()
    fused_views = set()
    for module in model.modules():
        if isinstance(module, FusedColumns) and isinstance(module.weight, GGUFWeight):
            fused_views.update(id(l.weight) for l in module.linears)
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(w, GGUFWeight) and id(w) not in seen and id(w) not in fused_views:
            seen.add(id(w))
            found.append(w)
    return found


def tensor_bytes(model: torch.nn.Module) -> int:
    """The bytes of the model's tensors: parameters, buffers and blocks, shared storage once."""
    storages = {}
    tensors = [*model.parameters(), *model.buffers()]
    for w in quantized_weights(model):
        tensors.extend(w.tensors())
    for t in tensors:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())
