"""``LLM.shutdown()``, ``with LLM(...) as llm:`` and ``del llm`` give the engine's memory back."""
import gc
import weakref

import pytest

from minipaged import LLM, SamplingParams


def weights_of(llm):
    return weakref.ref(next(llm.llm_engine.worker.model.parameters()))


def test_shutdown_frees_the_model_and_pools_and_refuses_more_work(tiny_llama):
    llm = LLM(tiny_llama[0], num_gpu_blocks=16, num_cpu_blocks=4, max_model_len=64)
    weights = weights_of(llm)
    pool = weakref.ref(llm.llm_engine.worker.cache_engine.gpu_cache[0][0])
    swap = weakref.ref(llm.llm_engine.worker.cache_engine.cpu_cache[0][0])
    llm.shutdown()
    assert weights() is None and pool() is None and swap() is None
    llm.shutdown()  # a second time: nothing happens
    assert llm.llm_engine.is_shut_down
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(prompt_token_ids=[[5, 6, 7]], use_tqdm=False)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.llm_engine.add_request(None, None, SamplingParams(), prompt_token_ids=[5, 6])


def test_with_block_shuts_down_even_after_an_error(tiny_llama):
    with pytest.raises(ValueError):
        with LLM(tiny_llama[0], num_gpu_blocks=16, max_model_len=64) as llm:
            weights = weights_of(llm)
            llm.generate(prompt_token_ids=[[5, 6, 7]], use_tqdm=False,
                         sampling_params=SamplingParams(temperature=-1))
    assert weights() is None and llm.llm_engine.is_shut_down


def test_del_frees_the_engine(tiny_llama):
    llm = LLM(tiny_llama[0], num_gpu_blocks=16, max_model_len=64)
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], use_tqdm=False,
                       sampling_params=SamplingParams(temperature=0, max_tokens=2))
    assert len(out[0].outputs[0].token_ids) == 2
    weights = weights_of(llm)
    del llm
    gc.collect()
    assert weights() is None
