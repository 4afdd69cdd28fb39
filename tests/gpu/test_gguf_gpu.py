"""``quantization="gguf"`` on a GPU (`make gpu-check`'s tests-gpu stage): the blocks go to the
device as stored and each matmul runs ``cuda`` (our kernel, csrc/gguf_matmul.cu: the blocks
dequantized inside the dot product) or ``dequant`` (a tile dequantized, then torch's matmul),
whichever measured faster per shape and bucket of rows. The kernel itself gives every format's
dequantized matmul (one-hot rows: the weights bit for bit). A tiny random LLaMA written as GGUF
gives on CUDA, in float32, with each routine forced and with the measured choice, the CPU's
teacher-forced logits within float tolerance and transformers' greedy tokens.
Not yet run on a GPU (written 2026-12-06 and 2026-12-07 without one)."""
import random

import pytest
import torch

from minipaged import LLM, SamplingParams
from gguf_random import random_blocks
from minipaged.engine.llm_engine import LLMEngine
from minipaged.kernels import build
from minipaged.kernels.gguf_blocks import FORMATS, dequantize
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
    monkeypatch.setattr(gguf_linear, "row_choices", {})
    monkeypatch.delenv("MINIPAGED_GGUF_ROUTINE", raising=False)


ROUTINES = ["cuda", "dequant", None]  # None: the measured choice


def force(monkeypatch, routine):
    if routine is not None:
        monkeypatch.setenv("MINIPAGED_GGUF_ROUTINE", routine)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("tiny_gguf_gpu")
    path, _ = save_tiny_gguf(str(folder), seed=3)
    reference = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file="tiny.gguf",
                                                     dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    return path, reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_kernel_gives_the_dequantized_matmul(name, dtype):
    kernels = build.CUDA_OP.load()
    fmt = FORMATS[name]
    blocks = torch.from_numpy(random_blocks(name, 67, 4, 0)).cuda()  # (67 rows: ragged)
    w = dequantize(blocks.cpu(), fmt).double()
    x = torch.randn(9, w.shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    got = kernels.gguf_linear(x.cuda(), blocks, fmt.ggml_type).cpu()
    reference = x.double() @ w.t()
    size = x.double().abs() @ w.abs().t()
    ulp = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]
    assert got.dtype == dtype
    assert ((got.double() - reference).abs()
            <= 64 * 2.0 ** -23 * size + ulp * reference.abs() + 1e-30).all()
    one_hot = torch.eye(w.shape[1])[:fmt.weights + 3].cuda()  # a whole block and 3 more
    assert torch.equal(kernels.gguf_linear(one_hot, blocks, fmt.ggml_type).cpu(),
                       dequantize(blocks.cpu(), fmt).t()[:fmt.weights + 3])


@pytest.mark.parametrize("routine", ROUTINES, ids=str)
def test_cuda_logits_equal_the_cpu_s(tiny_file, routine, monkeypatch):
    force(monkeypatch, routine)
    path, _ = tiny_file
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 256) for _ in range(n)] for n in (21, 14, 17)]
    on_cuda = LLMEngine(path, quantization="gguf", device="cuda", **SETTINGS)
    on_cpu = LLMEngine(path, quantization="gguf", device="cpu", **SETTINGS)
    if routine is not None:
        ran = {w.routine for w in gguf_linear_weights(on_cuda)}
        assert ran == {routine}, ran
    ours = teacher_forced_logits(on_cuda, prompts, num_prefill=9, block_size=16)
    theirs = teacher_forced_logits(on_cpu, prompts, num_prefill=9, block_size=16)
    for a, b in zip(ours, theirs):
        assert b.abs().max() > 1.0
        torch.testing.assert_close(a.cpu(), b, atol=5e-4, rtol=1e-3)


@pytest.mark.parametrize("routine", ROUTINES, ids=str)
def test_cuda_greedy_tokens_equal_transformers(tiny_file, routine, monkeypatch):
    force(monkeypatch, routine)
    path, reference = tiny_file
    prompts = pick_prompts(reference, [13, 18], 10, seed=4)
    expected = [greedy_reference(reference, p, 10) for p in prompts]
    llm = LLM(path, quantization="gguf", device="cuda", seed=0, **SETTINGS)
    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0, max_tokens=10,
                                                       ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


def gguf_linear_weights(engine):
    from minipaged.worker.gguf_loader import quantized_weights

    return list(quantized_weights(engine.worker.model))
