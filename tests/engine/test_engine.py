"""Lesson 09: continuous batching gives exactly transformers' greedy tokens, also under preemption.

Slow (left out of `make test`): the tests on the module's transformers references, about 260 s
together on the 2-core machine (measured at load ~12, so less when idle); the rest are fast.
"""
import pytest

from minipaged import LLM, SamplingParams
from tiny_models import config_with_eos, greedy_reference, pick_prompts

pytestmark = pytest.mark.lesson09

BLOCK = 16
# 1 token, exactly one block, one block + 1, several blocks, and lengths in between.
LENGTHS = [1, BLOCK, BLOCK + 1, 3 * BLOCK + 5, 5, 2 * BLOCK, 9, 70]
MAX_NEW = [48, 40, 48, 33, 48, 17, 48, 48]


@pytest.fixture(scope="module")
def cases(tiny_llama, tiny_gpt2):
    """Per architecture: prompts with a clear greedy path, and transformers' tokens for each."""
    out = {}
    for kind, (path, hf) in (("llama", tiny_llama), ("gpt2", tiny_gpt2)):
        prompts = pick_prompts(hf, LENGTHS, max(MAX_NEW), seed=11)
        refs = [greedy_reference(hf, p, n) for p, n in zip(prompts, MAX_NEW)]
        out[kind] = (path, prompts, refs)
    return out


def run(path, prompts, **kwargs):
    llm = LLM(path, block_size=BLOCK, **kwargs)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_NEW]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return llm, outs


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_greedy_batch_matches_transformers_prompt_by_prompt(cases, kind):
    path, prompts, refs = cases[kind]
    llm, outs = run(path, prompts, num_gpu_blocks=256)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    for prompt, ref, out in zip(prompts, refs, outs):
        assert out.prompt_token_ids == prompt
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == ref
    engine = llm.llm_engine
    # One generate call, continuous batching: far fewer steps than prompts x tokens.
    assert engine.stats.num_steps < sum(MAX_NEW) / 2
    assert engine.stats.num_preemptions_recompute == 0
    assert engine.block_manager.get_num_free_gpu_blocks() == 256


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_tiny_pool_forces_recompute_and_changes_nothing(cases, kind):
    path, prompts, refs = cases[kind]
    # The longest request needs ceil((75 + 48) / 16) = 8 blocks; 12 blocks can't hold them all.
    # (12 blocks hold 192 tokens, less than the model's 256: max_model_len must say so.)
    llm, outs = run(path, prompts, num_gpu_blocks=12, watermark=0.0, max_model_len=192)
    assert [o.outputs[0].token_ids for o in outs] == refs
    engine = llm.llm_engine
    assert engine.stats.num_preemptions_recompute > 0
    assert engine.stats.num_preemptions_swap == 0
    assert engine.block_manager.get_num_free_gpu_blocks() == 12
    assert not engine.has_unfinished_requests()


@pytest.mark.slow
def test_block_size_does_not_change_tokens(cases):
    path, prompts, refs = cases["llama"]
    for block_size in (1, 8, 32):
        llm = LLM(path, block_size=block_size, num_gpu_blocks=4096 // block_size)
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_NEW]
        outs = llm.generate(prompt_token_ids=prompts[:4], sampling_params=params[:4],
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == refs[:4], block_size


@pytest.mark.slow
def test_max_num_seqs_and_batched_tokens_limit_each_step(cases):
    path, prompts, refs = cases["gpt2"]
    # 128 tokens a step: the longest request (75 + 48 tokens) still fits whole.
    llm = LLM(path, block_size=BLOCK, num_gpu_blocks=256, max_num_seqs=3,
              max_num_batched_tokens=128)
    seen = []
    llm.llm_engine.add_observer(lambda snap: seen.append(snap))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_NEW]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert max(len(s.scheduler["running"]) for s in seen) <= 3
    assert max(s.num_batched_tokens for s in seen) <= 128
    assert len(seen) == llm.llm_engine.stats.num_steps  # one observer call per step


def test_eos_stops_a_request_and_frees_its_blocks(tiny_llama):
    path, hf = tiny_llama
    llm = LLM(path, block_size=BLOCK, num_gpu_blocks=64)
    prompt = [5, 6, 7]
    free_run = llm.generate(prompt_token_ids=[prompt],
                            sampling_params=SamplingParams(temperature=0, max_tokens=20,
                                                           ignore_eos=True), use_tqdm=False)
    tokens = free_run[0].outputs[0].token_ids
    # Treat the 5th generated token as EOS: generation must stop right there, EOS included.
    eos = tokens[4]
    llm = LLM(path, hf_config=config_with_eos(path, eos), block_size=BLOCK, num_gpu_blocks=64)
    assert llm.llm_engine.eos_token_ids == {eos}
    out = llm.generate(prompt_token_ids=[prompt],
                       sampling_params=SamplingParams(temperature=0, max_tokens=20),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == tokens[:tokens.index(eos) + 1]
    assert llm.llm_engine.block_manager.get_num_free_gpu_blocks() == 64


def test_generation_stops_at_the_models_maximum_length(tmp_path):
    from tiny_models import save_tiny_model

    save_tiny_model("gpt2", tmp_path, n_positions=40)
    llm = LLM(str(tmp_path), block_size=8, num_gpu_blocks=64)
    out = llm.generate(prompt_token_ids=[list(range(2, 32))],
                       sampling_params=SamplingParams(temperature=0, max_tokens=8,
                                                      ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8
    # A pool of 4 blocks of 8 tokens cannot hold a sequence of the model's 40 tokens: that is
    # refused at construction, whether max_model_len = 40 is asked for or left to the model,
    # and the message says what would fit.
    for kwargs in (dict(max_model_len=40), {}):
        with pytest.raises(ValueError, match=r"needs 5 blocks of 8 tokens, the pool has 4 blocks"
                                             r".*pass max_model_len=32 or a larger pool"):
            LLM(str(tmp_path), block_size=8, num_gpu_blocks=4, **kwargs)
    small = LLM(str(tmp_path), block_size=8, num_gpu_blocks=4, max_model_len=32)
    assert small.llm_engine.max_model_len == 32
    capped = small.generate(prompt_token_ids=[list(range(2, 32))], use_tqdm=False,
                            sampling_params=SamplingParams(max_tokens=20, ignore_eos=True))
    assert len(capped[0].outputs[0].token_ids) == 2
    assert capped[0].outputs[0].finish_reason == "length"
    out = llm.generate(prompt_token_ids=[list(range(2, 32))],
                       sampling_params=SamplingParams(temperature=0, max_tokens=20,
                                                      ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 10  # capped at max_model_len = 40
    assert out.outputs[0].finish_reason == "length"


def test_model_dir_without_tokenizer_works_with_token_ids_only(tiny_gpt2):
    path, _ = tiny_gpt2
    llm = LLM(path, num_gpu_blocks=32)
    assert llm.get_tokenizer() is None
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["hello"], use_tqdm=False)
    out = llm.generate(prompt_token_ids=[[3, 4, 5]], use_tqdm=False,
                       sampling_params=SamplingParams(temperature=0, max_tokens=3,
                                                      ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3 and out[0].outputs[0].text == ""


def test_seeded_sampling_is_reproducible_across_batches(tiny_llama):
    path, _ = tiny_llama
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_tokens=12, seed=123,
                            ignore_eos=True)
    a = LLM(path, num_gpu_blocks=64).generate(prompt_token_ids=[[9, 10, 11]],
                                              sampling_params=params, use_tqdm=False)
    other = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    b = LLM(path, num_gpu_blocks=64).generate(
        prompt_token_ids=[[4, 4, 4], [9, 10, 11], [7]], sampling_params=[other, params, other],
        use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[1].outputs[0].token_ids


@pytest.mark.slow
def test_top_k_1_is_greedy(cases):
    path, prompts, refs = cases["llama"]
    llm = LLM(path, block_size=BLOCK, num_gpu_blocks=256)
    outs = llm.generate(prompt_token_ids=prompts[:3], use_tqdm=False,
                        sampling_params=[SamplingParams(temperature=1.3, top_k=1, max_tokens=n,
                                                        ignore_eos=True) for n in MAX_NEW[:3]])
    assert [o.outputs[0].token_ids for o in outs] == refs[:3]
