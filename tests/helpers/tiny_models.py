"""Tiny random GPT-2, LLaMA, Qwen2, Qwen3, Mistral and Gemma 3 checkpoints, and prompts whose
greedy path is well defined.

Random tiny models have near-tied logits; a float32 implementation may then legitimately pick a
different token than the reference. We raise ``initializer_range`` so that gaps are common, and
keep only prompts whose float64 greedy path keeps a clear gap between the top two logits at every
step, so any correct float32 implementation must follow it.
"""
from __future__ import annotations

import random

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, Gemma3TextConfig, GPT2Config,
                          LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config)

VOCAB = 256
EOS = 1
WINDOW = 8  # the sliding window of the tiny windowed models: prompts of the tests are longer

# The LLaMA-like families: (config class, settings on top of the tiny LLaMA's)
_FAMILIES = {
    "qwen2": (Qwen2Config, {}),
    # layer 0 full, layer 1 sliding (Qwen's max_window_layers: the layers before it are full)
    "qwen2_window": (Qwen2Config, dict(use_sliding_window=True, sliding_window=WINDOW,
                                       max_window_layers=1)),
    "qwen3": (Qwen3Config, dict(head_dim=16)),
    "qwen3_window": (Qwen3Config, dict(head_dim=16, use_sliding_window=True,
                                       sliding_window=WINDOW, max_window_layers=1)),
    "mistral": (MistralConfig, dict(sliding_window=WINDOW)),
    "gemma3": (Gemma3TextConfig, dict(
        num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}})),
}
FAMILIES = sorted(_FAMILIES)


def make_config(kind: str, **overrides):
    if kind == "llama":
        cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                   initializer_range=0.3, bos_token_id=0, eos_token_id=EOS, pad_token_id=EOS,
                   tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                               "rope_theta": 10000.0})
        cfg.update(overrides)
        return LlamaConfig(**cfg)
    if kind in _FAMILIES:
        config_class, family = _FAMILIES[kind]
        cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                   initializer_range=0.3, bos_token_id=0, eos_token_id=EOS, pad_token_id=EOS,
                   tie_word_embeddings=False)
        cfg.update(family)
        cfg.update(overrides)
        return config_class(**cfg)
    if kind == "gpt2":
        cfg = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                   initializer_range=0.3, bos_token_id=0, eos_token_id=EOS, pad_token_id=EOS)
        cfg.update(overrides)
        return GPT2Config(**cfg)
    raise ValueError(kind)


def save_tiny_model(kind: str, path, seed: int = 0, **overrides):
    """Build a random model, save it with save_pretrained (no tokenizer files), return it."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(kind, **overrides)).eval()
    if kind in _FAMILIES:
        # transformers starts norms at 1 (Gemma's at 0) and biases at 0: random ones make a
        # wrong norm formula or a missing bias show in the logits
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.3)
    model.generation_config.eos_token_id = None  # compare with ignore_eos: never stop early
    model.generation_config.pad_token_id = EOS
    model.save_pretrained(path)
    return model


@torch.no_grad()
def config_with_eos(path, eos: int):
    """The saved model's config with ``eos`` as its end-of-sequence token (pass as hf_config=)."""
    config = AutoConfig.from_pretrained(path)
    config.eos_token_id = eos
    return config


def greedy_reference(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers generate on one prompt alone, greedy, fixed length."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=EOS)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def greedy_whole_sequence(model, prompts: list[list[int]], max_new_tokens: int, dtype,
                          device: str = "cuda") -> list[list[int]]:
    """transformers in ``dtype`` on ``device``, each prompt alone, the whole sequence run at
    every step (no cache): the GPU tests' reference in half precision."""
    import copy

    half = copy.deepcopy(model).to(device, dtype).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        for _ in range(max_new_tokens):
            ids = torch.cat([ids, half(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
        out.append(ids[0, len(prompt):].tolist())
    return out


@torch.no_grad()
def min_greedy_gap(model64, prompt: list[int], max_new_tokens: int) -> float:
    """Smallest top-1 minus top-2 logit along the float64 greedy path."""
    ids = list(prompt)
    gap = float("inf")
    for _ in range(max_new_tokens):
        logits = model64(torch.tensor([ids])).logits[0, -1]
        top = torch.topk(logits, 2).values
        gap = min(gap, float(top[0] - top[1]))
        ids.append(int(torch.argmax(logits)))
    return gap


def pick_prompts(model, lengths: list[int], max_new_tokens: int, seed: int = 0,
                 min_gap: float = 1e-3, tries: int = 40) -> list[list[int]]:
    """One prompt per requested length, each with a clear float64 greedy gap."""
    import copy

    model64 = copy.deepcopy(model).double()
    rng = random.Random(seed)
    prompts = []
    for length in lengths:
        best, best_gap = None, -1.0
        for _ in range(tries):
            candidate = [rng.randrange(2, VOCAB) for _ in range(length)]
            gap = min_greedy_gap(model64, candidate, max_new_tokens)
            if gap > best_gap:
                best, best_gap = candidate, gap
            if gap >= min_gap:
                break
        assert best_gap >= min_gap, f"no prompt of length {length} with a clear greedy path"
        prompts.append(best)
    return prompts
