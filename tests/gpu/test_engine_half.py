"""Issue 6 on a GPU: half precision end to end, a profiled KV pool, swapping through pinned memory.

These run only where CUDA is present (scripts/gpu_check.sh, `make gpu-check`).
"""
import copy

import pytest

torch = pytest.importorskip("torch")

from tiny_models import min_greedy_gap, save_tiny_model  # noqa: E402

pytestmark = pytest.mark.lesson08

HEAD_64 = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
               num_key_value_heads=2)
MAX_NEW = 24


@pytest.fixture(scope="module")
def half_case(tmp_path_factory):
    """A tiny LLaMA (head size 64) and prompts whose greedy path has wide top-2 gaps, so that
    float16 rounding (about 1e-3 relative) cannot flip a choice."""
    import random

    path = tmp_path_factory.mktemp("tiny_llama_half")
    model = save_tiny_model("llama", path, seed=7, **HEAD_64)
    model64 = copy.deepcopy(model).double()
    rng = random.Random(3)
    prompts = []
    while len(prompts) < 4:
        candidate = [rng.randrange(2, 256) for _ in range(rng.choice([1, 16, 17, 40]))]
        if min_greedy_gap(model64, candidate, MAX_NEW) > 0.3:
            prompts.append(candidate)
    hf16 = model.to("cuda", torch.float16)
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            for _ in range(MAX_NEW):
                ids = torch.cat([ids, hf16(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
            refs.append(ids[0, len(p):].tolist())
    return str(path), prompts, refs


@pytest.mark.parametrize("dtype", ["float16", "auto"])
def test_float16_engine_matches_transformers_float16(half_case, dtype):
    from minipaged import LLM, SamplingParams

    path, prompts, refs = half_case
    llm = LLM(path, dtype=dtype, device="cuda", gpu_memory_utilization=0.3)
    engine = llm.llm_engine
    assert engine.dtype == torch.float16  # "auto" on CUDA means half precision
    assert engine.worker.cache_engine.gpu_cache[0][0].dtype == torch.float16
    assert next(engine.worker.model.parameters()).dtype == torch.float16
    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                       ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == refs


def test_bfloat16_engine_runs_and_agrees_on_the_first_tokens(half_case):
    from minipaged import LLM, SamplingParams

    path, prompts, refs = half_case
    llm = LLM(path, dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3)
    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0, max_tokens=4,
                                                       ignore_eos=True))
    # bfloat16 has 8 bits of mantissa: only the first tokens are held to the float16 path.
    agree = sum(o.outputs[0].token_ids[:2] == r[:2] for o, r in zip(outs, refs))
    assert agree >= len(refs) - 1


def test_kv_pool_size_follows_gpu_memory_utilization(half_case):
    from minipaged import LLM

    path, _, _ = half_case
    sizes = {}
    for util in (0.2, 0.4):
        free = torch.cuda.mem_get_info()[0]  # (the previous engine gave everything back)
        # NOTE: max_num_seqs far above what the memory holds, so that the pool is not capped
        # at what max_num_seqs sequences could use; eager, so no graph has that many rows.
        with LLM(path, dtype="float16", device="cuda", gpu_memory_utilization=util,
                 max_num_seqs=1 << 20, enforce_eager=True) as llm:
            sizes[util] = llm.llm_engine.block_manager.num_total_gpu_blocks
            block_bytes = llm.llm_engine.block_bytes
    # the pool gets a share of what the process could take at the start: the extra 20 % of it
    # all goes to blocks
    expected = 0.2 * free / block_bytes
    assert sizes[0.4] > sizes[0.2] > 0
    assert abs((sizes[0.4] - sizes[0.2]) - expected) / expected < 0.05


def test_swapping_uses_pinned_memory_and_changes_nothing(half_case):
    from minipaged import LLM, SamplingParams

    path, prompts, _ = half_case
    params = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0,
                            max_tokens=MAX_NEW, ignore_eos=True)
    big = LLM(path, dtype="float16", device="cuda", num_gpu_blocks=512, num_cpu_blocks=64)
    small = LLM(path, dtype="float16", device="cuda", num_gpu_blocks=14, num_cpu_blocks=128,
                watermark=0.0, max_model_len=224)  # (14 blocks of 16 tokens)
    assert small.llm_engine.worker.cache_engine.cpu_cache[0][0].is_pinned()
    a = big.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    b = small.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in a] == \
        [[c.token_ids for c in o.outputs] for o in b]
    engine = small.llm_engine
    assert engine.stats.num_preemptions_swap > 0
    assert engine.block_manager.get_num_free_gpu_blocks() == 14
    assert engine.block_manager.get_num_free_cpu_blocks() == 128


def test_dummy_weights_build_on_the_gpu(tmp_path):
    from transformers import LlamaConfig

    from minipaged import LLM, SamplingParams

    LlamaConfig(**HEAD_64, num_hidden_layers=2, vocab_size=512, max_position_embeddings=256,
                bos_token_id=0, eos_token_id=1).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), load_format="dummy", dtype="float16", device="cuda",
              gpu_memory_utilization=0.2)
    assert next(llm.llm_engine.worker.model.parameters()).is_cuda
    out = llm.generate(prompt_token_ids=[[3, 4, 5]], use_tqdm=False,
                       sampling_params=SamplingParams(temperature=0, max_tokens=5,
                                                      ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5
