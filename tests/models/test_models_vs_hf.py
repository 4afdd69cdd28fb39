"""Lessons 07 and 08: our GPT-2 and LLaMA give transformers' logits, through prefill and paged decode."""
import random

import pytest
import torch

from minipaged.engine.llm_engine import LLMEngine
from paged_forward import teacher_forced_logits

pytestmark = [pytest.mark.lesson07, pytest.mark.lesson08]


@pytest.mark.parametrize("block_size", [4, 16])
def test_teacher_forced_logits_match_transformers(tiny_model, block_size):
    kind, path, hf = tiny_model
    engine = LLMEngine(path, block_size=block_size, num_gpu_blocks=64, dtype="float32")
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 256) for _ in range(n)] for n in (40, 23, 33)]
    ours = teacher_forced_logits(engine, prompts, num_prefill=7, block_size=block_size)
    for p, logits in zip(prompts, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]  # (len, vocab)
        assert ref.abs().max() > 1.0  # real-sized logits, not a trivially small comparison
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def test_llama_reads_rope_parameters(tmp_path):
    """A non-default RoPE (theta and linear scaling in rope_parameters) is honoured."""
    from tiny_models import save_tiny_model

    hf = save_tiny_model("llama", tmp_path, seed=3, num_attention_heads=4, num_key_value_heads=1,
                         rope_parameters={"rope_type": "linear", "rope_theta": 500.0,
                                          "factor": 2.0})
    engine = LLMEngine(str(tmp_path), block_size=8, num_gpu_blocks=32)
    prompt = list(range(5, 45))
    (ours,) = teacher_forced_logits(engine, [prompt], num_prefill=20, block_size=8)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_tied_embeddings_llama(tmp_path):
    from tiny_models import save_tiny_model

    hf = save_tiny_model("llama", tmp_path, seed=4, tie_word_embeddings=True)
    engine = LLMEngine(str(tmp_path), block_size=16, num_gpu_blocks=16)
    prompt = list(range(3, 30))
    (ours,) = teacher_forced_logits(engine, [prompt], num_prefill=27, block_size=16)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
