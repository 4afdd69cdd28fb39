"""The workload helper the random-workload properties share (tests/helpers/workloads.py): a
refused request leaves the engine as it was, and ``fitted`` makes every request fit the pool
(a full run drew an n = 2 request of 35 prompt tokens and 15 new ones in a pool of 17 blocks
of 4: refused, and the shared engine then kept request "0" for the next example)."""
import pytest

from minipaged.engine.llm_engine import LLMEngine
from minipaged.validation import max_blocks_needed
from workloads import fitted, params_of_kind, run_to_end


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(tiny_llama[0], block_size=4, num_gpu_blocks=17, num_cpu_blocks=16,
                     max_model_len=64, dtype="float32", seed=0)


def test_a_refused_request_takes_back_the_ones_added_before_it(engine):
    prompt = list(range(2, 37))  # 35 tokens
    too_big = params_of_kind("sampled", 0, 15)  # n = 2: 18 blocks of 4, the pool has 17
    with pytest.raises(ValueError, match="can never fit in the KV pool"):
        run_to_end(engine, [[5, 6, 7], prompt], [params_of_kind("greedy", 0, 2), too_big])
    assert not engine.has_unfinished_requests()
    # the same engine takes the same ids again, and the fitted request runs to its end
    fit = fitted(engine, prompt, too_big)
    assert fit.max_tokens < 15 and fit.n == 2 and fit.seed == too_big.seed
    assert max_blocks_needed(len(prompt), fit, engine.limits) <= 17
    out = run_to_end(engine, [[5, 6, 7], prompt], [params_of_kind("greedy", 0, 2), fit])
    assert [len(o.token_ids) for o in out[1].outputs] == [fit.max_tokens] * 2


@pytest.mark.parametrize("kind", ["greedy", "sampled", "beam"])
@pytest.mark.parametrize("prompt_len", [1, 17, 33, 35, 36, 60])
def test_fitted_is_the_largest_max_tokens_that_fits(engine, kind, prompt_len):
    params = params_of_kind(kind, 1, 16)
    fit = fitted(engine, list(range(prompt_len)), params)
    assert max_blocks_needed(prompt_len, fit, engine.limits) <= 17 or fit.max_tokens == 1
    if fit.max_tokens < 16:  # lowered only as far as needed
        bigger = params_of_kind(kind, 1, fit.max_tokens + 1)
        assert max_blocks_needed(prompt_len, bigger, engine.limits) > 17
