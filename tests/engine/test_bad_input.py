"""Bad input gets a clear ValueError before any work starts, and never loses other requests."""
import numpy as np
import pytest
import torch

from minipaged import LLM, LLMEngine, SamplingParams


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n"), (dict(n=1.5), "n"), (dict(n=3, best_of=2), "best_of"),
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=0), "top_k"), (dict(top_k=-5), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"), (dict(logprobs=-1), "logprobs"),
    (dict(stop=[""]), "stop"), (dict(seed="x"), "seed"),
    (dict(use_beam_search=True, best_of=1, temperature=0), "best_of"),
    (dict(use_beam_search=True, best_of=2, temperature=0.5), "temperature"),
    (dict(use_beam_search=True, best_of=2, temperature=0, top_p=0.9), "top_p"),
    (dict(use_beam_search=True, best_of=2, temperature=0, top_k=3), "top_k"),
])
def test_invalid_sampling_params_name_the_field_and_range(kwargs, field):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    message = str(err.value)
    assert message.startswith(field), message
    assert any(w in message for w in ("must be", ">=", "in [", "in (")), message


@pytest.fixture
def llm(tiny_llama):
    path, _ = tiny_llama
    return LLM(path, block_size=8, num_gpu_blocks=20, watermark=0.0, max_model_len=160)


def test_empty_prompt_raises_before_anything_runs(llm):
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        llm.generate(prompt_token_ids=[[5, 6], []], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.stats.num_steps == 0


def test_prompt_longer_than_the_model_raises(tiny_llama):
    llm = LLM(tiny_llama[0], block_size=8, num_gpu_blocks=64, watermark=0.0)
    too_long = list(range(2, 200)) + list(range(2, 100))  # 296 tokens > 256 positions
    with pytest.raises(ValueError, match="maximum length is 256 tokens .the model's maximum"):
        llm.generate(prompt_token_ids=[[5, 6], too_long], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_pool_smaller_than_the_models_length_is_refused_at_construction(tiny_llama):
    # 20 blocks of 8 tokens hold 160 tokens, not the model's 256: refused, with the numbers and
    # what to pass instead, rather than silently shortening every request.
    with pytest.raises(ValueError) as err:
        LLM(tiny_llama[0], block_size=8, num_gpu_blocks=20, watermark=0.1)
    assert str(err.value) == (
        "the KV pool cannot hold one request of max_model_len (256) tokens: it needs 32 blocks "
        "of 8 tokens, the pool has 20 blocks of which 18 are usable (watermark 0.1 keeps 2 "
        "free), 144 tokens; pass max_model_len=144 or a larger pool (num_gpu_blocks >= 35)")


def test_tiny_pools_are_refused_naming_the_numbers(tiny_llama, tiny_gpt2):
    for path in (tiny_llama[0], tiny_gpt2[0]):
        with pytest.raises(ValueError, match=r"needs 16 blocks of 16 tokens, the pool has 2 "
                                             r"blocks of which 2 are usable.*"
                                             r"pass max_model_len=32 or a larger pool"):
            LLM(path, num_gpu_blocks=2)
    with pytest.raises(ValueError, match=r"the pool has 1 blocks of which 1 are usable .*"
                                         r"16 tokens; pass max_model_len=16"):
        LLM(tiny_llama[0], num_gpu_blocks=1, max_model_len=20)
    with pytest.raises(ValueError, match=r"pool has 1 blocks .* give a larger pool"):
        LLM(tiny_llama[0], num_gpu_blocks=1, block_size=1)


def test_a_step_budget_smaller_than_the_models_length_is_refused_without_chunking(tiny_llama):
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(100\) is smaller than "
                                         r"max_model_len \(256\).*pass max_model_len=100"):
        LLM(tiny_llama[0], max_num_batched_tokens=100, enable_chunked_prefill=False)
    # With chunked prefill the budget limits a step, not a prompt: accepted.
    assert LLM(tiny_llama[0], max_num_batched_tokens=100).llm_engine.max_model_len == 256


def test_prompt_longer_than_max_model_len_raises_naming_it(llm):
    with pytest.raises(ValueError, match=r"maximum length is 160 tokens \(max_model_len\)"):
        llm.generate(prompt_token_ids=[list(range(2, 200))], use_tqdm=False)


def test_token_ids_outside_the_vocabulary_raise(llm):
    with pytest.raises(ValueError, match=r"integers in \[0, 256\)"):
        llm.generate(prompt_token_ids=[[5, 300]], use_tqdm=False)


def test_request_that_can_never_fit_the_pool_raises_instead_of_spinning(llm):
    # 20 blocks of 8 tokens = 160 tokens; 4 samples of 100 + 50 tokens can never be held at once:
    # 12 shared prompt blocks + 4 x 7 blocks of their own = 40 blocks.
    with pytest.raises(ValueError, match="may need 40 blocks of 8 tokens.*pool has 20 usable"):
        llm.generate(prompt_token_ids=[list(range(2, 102))], use_tqdm=False,
                     sampling_params=SamplingParams(n=4, max_tokens=50))
    # The same engine still serves requests that fit.
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], use_tqdm=False,
                       sampling_params=SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) <= 4


def test_a_bad_prompt_among_good_ones_loses_nothing(llm):
    good = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    with pytest.raises(ValueError):
        llm.generate(prompt_token_ids=[[5, 6], [7, 8], []], sampling_params=good,
                     use_tqdm=False)
    outs = llm.generate(prompt_token_ids=[[5, 6], [7, 8]], sampling_params=good,
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]


def test_mismatched_argument_lengths_raise(llm):
    with pytest.raises(ValueError, match="sampling_params for 2 prompts"):
        llm.generate(prompt_token_ids=[[5], [6]], use_tqdm=False,
                     sampling_params=[SamplingParams()] * 3)
    with pytest.raises(ValueError, match="give prompts or prompt_token_ids"):
        llm.generate(use_tqdm=False)


def test_abort_frees_blocks_and_keeps_other_requests(tiny_llama):
    path, _ = tiny_llama
    engine = LLMEngine(path, block_size=8, num_gpu_blocks=40, watermark=0.0)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", None, params, list(range(2, 30)))
    engine.add_request("b", None, params, list(range(3, 12)))
    for _ in range(3):
        engine.step()
    used_before = 40 - engine.block_manager.get_num_free_gpu_blocks()
    aborted = engine.abort_request("a")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert len(aborted.outputs[0].token_ids) == 3
    assert 40 - engine.block_manager.get_num_free_gpu_blocks() < used_before
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
    assert set(results) == {"b"} and len(results["b"].outputs[0].token_ids) == 30
    assert engine.block_manager.get_num_free_gpu_blocks() == 40
    assert engine.abort_request("no-such-request") is None


def test_duplicate_request_id_raises(tiny_llama):
    path, _ = tiny_llama
    engine = LLMEngine(path, num_gpu_blocks=16)
    engine.add_request("x", None, SamplingParams(), [3, 4])
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", None, SamplingParams(), [3, 4])


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=3), "block_size"), (dict(dtype="int8"), "dtype"),
    (dict(preemption_mode="sometimes"), "sometimes"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(load_format="pickle"), "load_format"),
])
def test_invalid_engine_settings_raise(tiny_gpt2, kwargs, match):
    path, _ = tiny_gpt2
    with pytest.raises(ValueError, match=match):
        LLM(path, num_gpu_blocks=16, **kwargs)


def test_unknown_model_raises_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot load model"):
        LLM(str(tmp_path / "no-such-model"))


def test_stop_strings_without_a_tokenizer_raise(llm):
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate(prompt_token_ids=[[5, 6]], use_tqdm=False,
                     sampling_params=SamplingParams(stop=["\n"]))


def test_sampling_params_changed_after_construction_are_checked_again(llm):
    engine = llm.llm_engine
    changes = [("temperature", float("nan"), "temperature must be a finite number >= 0, got nan"),
               ("seed", 2**70, "seed must be None or an integer in"),
               ("top_k", 0, "top_k must be -1"), ("stop", [""], "stop must be"),
               ("n", 2, r"best_of must be an integer >= n \(2\), got 1")]
    for name, value, message in changes:
        params = SamplingParams(max_tokens=3)
        setattr(params, name, value)
        with pytest.raises(ValueError, match=f"prompt 1: {message}"):
            llm.generate(prompt_token_ids=[[5, 6], [7, 8]],
                         sampling_params=[SamplingParams(), params], use_tqdm=False)
        with pytest.raises(ValueError, match=message):
            engine.add_request("x", None, params, [5, 6])
        assert not engine.has_unfinished_requests()


HUGE = 10**400  # beyond the float range: math.isfinite(HUGE) raises OverflowError


@pytest.mark.parametrize("name", ["temperature", "top_p", "presence_penalty",
                                  "frequency_penalty"])
@pytest.mark.parametrize("value", [HUGE, -HUGE])
def test_huge_integers_are_value_errors_naming_the_field(name, value):
    with pytest.raises(ValueError, match=f"^{name} must be .*got -?1000...000 .401 digits.$"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("kwargs, message", [
    (dict(watermark=HUGE), r"watermark must be a number in \[0, 1\), got 1000...000 "),
    (dict(swap_space=HUGE), r"swap_space must be a finite number of GiB >= 0, got 1000"),
    (dict(kv_cache_bytes=HUGE), "kv_cache_bytes must be None or a number of bytes > 0"),
    (dict(gpu_memory_utilization=-HUGE), "gpu_memory_utilization must be a number in"),
    (dict(tensor_parallel_size=True), "tensor_parallel_size must be an integer >= 1, got True"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1, got 0"),
    (dict(device="tpu"), "device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    (dict(device=3.5), "device must be .* got 3.5"),
    (dict(preemption_mode=5), "preemption_mode must be None, 'recompute' or 'swap', got 5"),
    (dict(worker_timeout=True), "worker_timeout must be a number of seconds > 0, got True"),
    (dict(num_gpu_blocks=np.bool_(True)), "num_gpu_blocks must be None or an integer >= 1"),
    (dict(max_model_len=np.float64(64.0)), "max_model_len must be None or an integer >= 2"),
])
def test_engine_settings_of_the_wrong_kind_name_the_setting(tiny_gpt2, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_gpt2[0], **kwargs)


def test_cuda_without_a_gpu_is_a_value_error(tiny_gpt2):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="device 'cuda' needs a CUDA GPU"):
        LLM(tiny_gpt2[0], device="cuda")


def test_huge_arrival_times_are_value_errors(llm):
    with pytest.raises(ValueError, match=r"arrival_time must be a finite number .seconds., got "
                                         r"1000...000 .401 digits."):
        llm.llm_engine.add_request("a", None, SamplingParams(), [3, 4], arrival_time=HUGE)
    assert not llm.llm_engine.has_unfinished_requests()


def test_numpy_scalars_are_python_numbers_and_bools_are_refused(tiny_gpt2):
    params = SamplingParams(n=np.int64(2), best_of=np.int32(3), temperature=np.float32(0.5),
                            top_p=np.float64(0.9), top_k=np.int16(40), max_tokens=np.uint8(4),
                            seed=np.int64(7), logprobs=np.int64(2), ignore_eos=True)
    assert (params.n, params.best_of, params.temperature, params.top_k) == (2, 3, 0.5, 40)
    assert all(type(getattr(params, f)) is int
               for f in ("n", "best_of", "top_k", "max_tokens", "seed", "logprobs"))
    assert type(params.temperature) is float and type(params.top_p) is float
    for kwargs in (dict(n=True), dict(n=np.bool_(True)), dict(max_tokens=np.float32(4)),
                   dict(temperature=np.bool_(False)), dict(seed=np.float64(1.0))):
        with pytest.raises(ValueError, match=f"^{next(iter(kwargs))} must be"):
            SamplingParams(**kwargs)
    llm = LLM(tiny_gpt2[0], num_gpu_blocks=np.int64(16), block_size=np.int32(16),
              max_num_seqs=np.int64(4), watermark=np.float32(0.0), seed=np.int64(3))
    engine = llm.llm_engine
    assert engine.block_manager.num_total_gpu_blocks == 16 and type(engine.block_size) is int
    same = SamplingParams(n=2, best_of=3, temperature=0.5, top_p=float(np.float64(0.9)),
                          top_k=40, max_tokens=4, seed=7, logprobs=2, ignore_eos=True)
    a, b = (llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=p, use_tqdm=False)[0]
            for p in (params, same))
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
