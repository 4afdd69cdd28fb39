"""``quantization="gguf"`` on a GPU (`make gpu-check`'s tests-gpu stage): the blocks go to the
device as stored and every matmul dequantizes a tile there (the ``dequant`` routine: the C++ op and
torch's 4-bit kernel are CPU routines). A tiny random LLaMA written as GGUF gives on CUDA, in
float32, the CPU's teacher-forced logits within float tolerance and transformers' greedy tokens.
Not yet run on a GPU (written 2026-12-06 without one)."""
import random

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.engine.llm_engine import LLMEngine
from minipaged.lab.tiny_gguf import save_tiny_gguf
from minipaged.models import gguf_linear
from minipaged.worker import checkpoint
from paged_forward import teacher_forced_logits
from tiny_models import greedy_reference, pick_prompts

gguf = pytest.importorskip("gguf")
SETTINGS = dict(block_size=16, num_gpu_blocks=64, max_model_len=256, dtype="float32")


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setattr(checkpoint, "cache_root",
                        lambda: tmp_path_factory.getbasetemp() / "gguf_cache")
    monkeypatch.setattr(gguf_linear, "choices", {})


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("tiny_gguf_gpu")
    path, _ = save_tiny_gguf(str(folder), seed=3)
    reference = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file="tiny.gguf",
                                                     dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    return path, reference


def test_cuda_logits_equal_the_cpu_s(tiny_file):
    path, _ = tiny_file
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 256) for _ in range(n)] for n in (21, 14, 17)]
    on_cuda = LLMEngine(path, quantization="gguf", device="cuda", **SETTINGS)
    on_cpu = LLMEngine(path, quantization="gguf", device="cpu", **SETTINGS)
    ours = teacher_forced_logits(on_cuda, prompts, num_prefill=9, block_size=16)
    theirs = teacher_forced_logits(on_cpu, prompts, num_prefill=9, block_size=16)
    for a, b in zip(ours, theirs):
        assert b.abs().max() > 1.0
        torch.testing.assert_close(a.cpu(), b, atol=5e-4, rtol=1e-3)


def test_cuda_greedy_tokens_equal_transformers(tiny_file):
    path, reference = tiny_file
    prompts = pick_prompts(reference, [13, 18], 10, seed=4)
    expected = [greedy_reference(reference, p, 10) for p in prompts]
    llm = LLM(path, quantization="gguf", device="cuda", seed=0, **SETTINGS)
    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0, max_tokens=10,
                                                       ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
