"""Bad input gets a clear ValueError before any work starts, and never loses other requests."""
import pytest

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
    return LLM(path, block_size=8, num_gpu_blocks=20, watermark=0.0)


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


def test_prompt_longer_than_the_pool_holds_raises_naming_the_pool(llm):
    # 20 blocks of 8 tokens: max_model_len is lowered to 160 tokens, and says why.
    with pytest.raises(ValueError, match="maximum length is 160 tokens .what the KV pool"):
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
        LLM(path, num_gpu_blocks=8, **kwargs)


def test_unknown_model_raises_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot load model"):
        LLM(str(tmp_path / "no-such-model"))


def test_stop_strings_without_a_tokenizer_raise(llm):
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate(prompt_token_ids=[[5, 6]], use_tqdm=False,
                     sampling_params=SamplingParams(stop=["\n"]))
