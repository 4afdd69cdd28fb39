"""A LLaMA or a Gemma 3 written as a GGUF file, as llama.cpp's converter writes one: LLaMA's q and
k rows in llama.cpp's order, Gemma's norms as ``1 + weight``, the matrices quantized by the
``gguf`` package (Q4_1, Q5_0, Q8_0, ...), the norms in float32, no tokenizer (prompts are token
ids). ``save_tiny_gguf`` makes a tiny random one (``lab/tiny_families.py``) for tests and
``benchmarks/gguf_decode.py --small``."""
from __future__ import annotations

import numpy as np


def _llama_cpp_order(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (transformers' GGUF loader undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GEMMA3_NAMES = {**_NAMES, "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm",
                 "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def gguf_name(name: str, arch: str = "llama") -> str:
    name = name.removeprefix("model.")
    if name.startswith("layers."):
        _, layer, rest = name.split(".", 2)
        part, _, kind = rest.rpartition(".")
        return f"blk.{layer}.{(_GEMMA3_NAMES if arch == 'gemma3' else _NAMES)[part]}.{kind}"
    return {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[name]


def save_tiny_gguf(folder, seed: int = 0, layers: str = "Q4_1", embedding: str = "Q8_0",
                   family: str = "llama", formats: dict | None = None) -> tuple[str, object]:
    """A tiny random LLaMA (or ``family="gemma3"``) as ``folder/tiny.gguf``: (the file's path,
    the transformers model the file was written from; its weights before quantization)."""
    import os

    from minipaged.lab.tiny_families import save_tiny

    os.makedirs(os.path.join(folder, "hf"), exist_ok=True)
    model = save_tiny(family, os.path.join(folder, "hf"), seed=seed)
    path = os.path.join(folder, "tiny.gguf")
    return write_llama_gguf(path, model, layers, embedding, formats), model


def write_llama_gguf(path, model, layers: str = "Q4_1", embedding: str = "Q8_0",
                     formats: dict | None = None) -> str:
    """Write ``model`` (a transformers LlamaForCausalLM or Gemma3ForCausalLM) to the GGUF file
    ``path``: its matrices in the format ``layers`` (``formats`` names others by GGUF part,
    e.g. ``{"attn_v": "Q8_0"}``), its embedding and output layer in ``embedding``."""
    import gguf

    cfg = model.config
    arch = "gemma3" if cfg.model_type.startswith("gemma3") else "llama"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])  # (Gemma: global)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    if arch == "gemma3":
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_sliding_window(cfg.sliding_window)
    else:
        writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    tied = getattr(cfg, "tie_word_embeddings", False)
    for name, tensor in model.state_dict().items():
        if tied and name.endswith("lm_head.weight"):
            continue  # (the embedding's rows: the file holds them once)
        w = tensor.detach().float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = _llama_cpp_order(w, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            w = _llama_cpp_order(w, cfg.num_key_value_heads)
        target = gguf_name(name, arch)
        if w.ndim == 1:
            writer.add_tensor(target, w + 1 if arch == "gemma3" and "norm" in name else w)
            continue
        part = target.split(".")[-2]
        fmt = (embedding if "embed_tokens" in name or "lm_head" in name
               else (formats or {}).get(part, layers))
        qtype = gguf.GGMLQuantizationType[fmt]
        writer.add_tensor(target, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
