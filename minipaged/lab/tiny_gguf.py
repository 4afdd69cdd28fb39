"""A LLaMA written as a GGUF file, as llama.cpp's converter writes one: q and k rows in
llama.cpp's order, the matrices quantized by the ``gguf`` package (Q4_1, Q8_0, ...), the norms in
float32, no tokenizer (prompts are token ids). ``save_tiny_gguf`` makes a tiny random one
(``lab/tiny_families.py``) for tests and ``benchmarks/gguf_decode.py --small``."""
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


def gguf_name(name: str) -> str:
    name = name.removeprefix("model.")
    if name.startswith("layers."):
        _, layer, rest = name.split(".", 2)
        part, _, kind = rest.rpartition(".")
        return f"blk.{layer}.{_NAMES[part]}.{kind}"
    return {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[name]


def save_tiny_gguf(folder, seed: int = 0, layers: str = "Q4_1",
                   embedding: str = "Q8_0") -> tuple[str, object]:
    """A tiny random LLaMA as ``folder/tiny.gguf``: (the file's path, the transformers model the
    file was written from; its weights before quantization)."""
    import os

    from minipaged.lab.tiny_families import save_tiny

    os.makedirs(os.path.join(folder, "hf"), exist_ok=True)
    model = save_tiny("llama", os.path.join(folder, "hf"), seed=seed)
    path = os.path.join(folder, "tiny.gguf")
    return write_llama_gguf(path, model, layers, embedding), model


def write_llama_gguf(path, model, layers: str = "Q4_1", embedding: str = "Q8_0") -> str:
    """Write ``model`` (a transformers LlamaForCausalLM) to the GGUF file ``path``: its matrices
    in the format ``layers``, its embedding and output layer in ``embedding``."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    for name, tensor in model.state_dict().items():
        w = tensor.detach().float().numpy()
        if name.endswith("q_proj.weight"):
            w = _llama_cpp_order(w, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = _llama_cpp_order(w, cfg.num_key_value_heads)
        if w.ndim == 1:
            writer.add_tensor(gguf_name(name), w)
            continue
        fmt = embedding if "embed_tokens" in name or "lm_head" in name else layers
        qtype = gguf.GGMLQuantizationType[fmt]
        writer.add_tensor(gguf_name(name), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
