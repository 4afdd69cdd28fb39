"""``quantization="gguf"``: a LLaMA GGUF file's weights held as its blocks (issue 58). A tiny random
LLaMA written as GGUF (Q4_1 layers, Q8_0 embedding and head) gives, read as stored, the logits of
the same file converted through transformers to float32, within float tolerance, and
transformers' greedy tokens; a file with a block format minipaged does not read is refused by
name before any weight loads."""
import os
import random

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.engine.llm_engine import LLMEngine
from minipaged.models import gguf_linear
from minipaged.models.gguf_linear import GGUFWeight
from minipaged.worker import checkpoint
from minipaged.worker.gguf_loader import quantized_weights, tensor_bytes
from paged_forward import teacher_forced_logits
from minipaged.lab.tiny_gguf import save_tiny_gguf
from tiny_models import greedy_reference, pick_prompts

gguf = pytest.importorskip("gguf")


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    """The tiny files' configs and conversions in a folder of their own, never the user's cache
    (which keeps the compiled op: ``MINIPAGED_CACHE`` would build it again)."""
    folder = tmp_path_factory.getbasetemp() / "gguf_cache"
    monkeypatch.setattr(checkpoint, "cache_root", lambda: folder)
    monkeypatch.setattr(gguf_linear, "choices", {})
    monkeypatch.delenv("MINIPAGED_GGUF_ROUTINE", raising=False)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    """(the GGUF file, transformers' model read from it) of a tiny random LLaMA."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("tiny_gguf")
    path, _ = save_tiny_gguf(str(folder), seed=3)
    reference = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file="tiny.gguf",
                                                     dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    return path, reference


SETTINGS = dict(block_size=4, num_gpu_blocks=64, max_model_len=256, dtype="float32")


@pytest.mark.parametrize("routine", [None, "cpp", "int4pack", "dequant"])
def test_logits_equal_the_float32_path_within_float_tolerance(tiny_file, routine, monkeypatch):
    path, reference = tiny_file
    if routine is not None:
        monkeypatch.setenv("MINIPAGED_GGUF_ROUTINE", routine)
    quantized = LLMEngine(path, quantization="gguf", **SETTINGS)
    float32 = LLMEngine(path, **SETTINGS)
    weights = quantized_weights(quantized.worker.model)
    assert {w.fmt.name for w in weights} == {"Q4_1", "Q8_0"}
    if routine is not None:
        assert any(w.routine == routine for w in weights)  # (where the routine can run)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 256) for _ in range(n)] for n in (21, 14, 17)]
    ours = teacher_forced_logits(quantized, prompts, num_prefill=9, block_size=4)
    theirs = teacher_forced_logits(float32, prompts, num_prefill=9, block_size=4)
    for p, a, b in zip(prompts, ours, theirs):
        with torch.no_grad():
            ref = reference(torch.tensor([p])).logits[0]
        assert ref.abs().max() > 1.0
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(a, ref, atol=2e-4, rtol=1e-4)


def test_greedy_tokens_equal_transformers_on_the_file(tiny_file):
    path, reference = tiny_file
    prompts = pick_prompts(reference, [13, 18], 10, seed=4)
    expected = [greedy_reference(reference, p, 10) for p in prompts]
    llm = LLM(path, quantization="gguf", seed=0, **SETTINGS)
    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0, max_tokens=10,
                                                       ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


def test_the_model_holds_blocks_not_float32(tiny_file):
    path, _ = tiny_file
    model = LLMEngine(path, quantization="gguf", **SETTINGS).worker.model
    float_model = LLMEngine(path, **SETTINGS).worker.model
    assert not any(p.dim() == 2 for p in model.parameters())  # only the norms are parameters
    layer = model.layers[0]
    assert isinstance(layer.self_attn.qkv.weight, GGUFWeight)
    assert layer.self_attn.qkv.fused  # q, k, v: views of the fused blocks' rows
    blocks = sum(t.nbytes for w in quantized_weights(model) for t in w.tensors())
    floats = sum(p.nbytes for p in float_model.parameters() if p.dim() == 2)
    assert blocks < floats / 4
    assert tensor_bytes(model) < tensor_bytes(float_model) / 2


def test_a_block_format_not_read_is_named_before_any_weight_loads(tmp_path):
    path, _ = save_tiny_gguf(str(tmp_path), seed=3, layers="Q5_0")
    from minipaged.worker import gguf_loader

    loads = []
    real_setattr = gguf_loader.GGUFWeight.__init__
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_loader.GGUFWeight, "__init__",
                   lambda *a, **k: loads.append(1) or real_setattr(*a, **k))
        with pytest.raises(ValueError, match=r"Q5_0 is not supported: minipaged reads Q8_0, "
                                             r"Q4_1, Q4_K, Q6_K"):
            LLM(path, quantization="gguf", **SETTINGS)
    assert loads == []


def test_quantization_needs_a_gguf_file(tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match="quantization='gguf' reads a GGUF file"):
        LLM(path, quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be None or 'gguf'"):
        LLM(path, quantization="awq")
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        LLM(path, quantization="gguf", tensor_parallel_size=2)
