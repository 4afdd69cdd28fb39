"""The embedded SmolLM2 with ``quantization="gguf"`` (issue 58): its Q4_1 layers and Q8_0
embedding (also its tied output layer) held as the file's blocks give the float32 path's logits
within float tolerance, teacher-forced, and its greedy tokens; the model's tensors take at most
160 MB (the float32 path's: about 540 MB of weights).

Slow: two engines of the 135M model (the float32 path's conversion cached, else about 30 s more).
"""
import random

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.worker.gguf_loader import quantized_weights, tensor_bytes
from paged_forward import teacher_forced_logits

pytestmark = pytest.mark.slow

SETTINGS = dict(block_size=16, num_gpu_blocks=64, max_model_len=512, dtype="float32")


@pytest.fixture(scope="module")
def llms():
    return LLM(quantization="gguf", **SETTINGS), LLM(quantization="none", **SETTINGS)


@pytest.fixture(scope="module")
def engines(llms):
    return tuple(llm.llm_engine for llm in llms)


def test_logits_equal_the_float32_path_within_float_tolerance(engines):
    quantized, float32 = engines
    rng = random.Random(0)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a robot"]
    prompts = [quantized.tokenizer.encode(t) + [rng.randrange(100, 40000) for _ in range(12)]
               for t in texts]
    ours = teacher_forced_logits(quantized, prompts, num_prefill=5, block_size=16)
    theirs = teacher_forced_logits(float32, prompts, num_prefill=5, block_size=16)
    for a, b in zip(ours, theirs):
        assert b.abs().max() > 5.0
        torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-3)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_greedy_tokens_equal_the_float32_path(llms):
    prompts = ["The capital of France is", "Write a haiku about the sea.\n"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = [[list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                 use_tqdm=False)]
            for llm in llms]
    assert outs[0] == outs[1]


def test_the_model_s_tensors_take_at_most_160_mb(engines):
    quantized, float32 = engines
    model = quantized.worker.model
    assert {w.fmt.name for w in quantized_weights(model)} == {"Q4_1", "Q8_0"}
    assert tensor_bytes(model) <= 160e6
    assert tensor_bytes(float32.worker.model) > 500e6
