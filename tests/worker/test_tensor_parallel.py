"""Tensor parallelism (lesson 14): N gloo workers give the tokens and logits of one process.

Every engine here starts worker processes (a few seconds each on a busy CPU), so the engines
are shared per model (module fixtures) and the tests that break their engine on purpose (a
killed worker, a hung worker) come last and use it last.

Slow: ~195 s on the 2-core machine (measured at load ~9).
"""
import gc
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.models.gpt2 import GPT2Attention
from minipaged.models.parallel_layers import copy_shard_from, tensor_parallel_state
from minipaged.worker.tensor_parallel import WorkerError, shard_weight_bytes
from repo_paths import ROOT
from tiny_models import make_config, save_tiny_model
from tp_helpers import ENGINE, NEW_TOKENS
from tp_helpers import assert_same_outputs as _assert_same_outputs
from tp_helpers import gone as _gone
from tp_helpers import workload as _workload

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gpt2_6_heads(tmp_path_factory):
    """GPT-2 with 6 heads, so that N = 3 splits it; vocabulary 256 is padded to 258."""
    path = tmp_path_factory.mktemp("gpt2_6_heads")
    return str(path), save_tiny_model("gpt2", path, n_head=6, n_embd=96)


def _run_both(path, model, world_size, **engine):
    """The workload on one rank and on ``world_size`` ranks; the workers stop afterwards."""
    prompts, params = _workload(model)
    engine = {**ENGINE, **engine}
    single = LLM(path, **engine)
    reference = single.generate(prompt_token_ids=prompts, sampling_params=params,
                                use_tqdm=False)
    parallel = LLM(path, tensor_parallel_size=world_size, **engine)
    outputs = parallel.generate(prompt_token_ids=prompts, sampling_params=params,
                                use_tqdm=False)
    yield single, reference, parallel, outputs, (prompts, params)
    parallel.llm_engine.shutdown()


@pytest.fixture(scope="module")
def llama_runs(tiny_llama):
    yield from _run_both(*tiny_llama, 2)


@pytest.fixture(scope="module")
def gpt2_runs(gpt2_6_heads):
    yield from _run_both(*gpt2_6_heads, 3)


@pytest.fixture(scope="module")
def gpt2_two_ranks(tiny_gpt2):
    """GPT-2 (4 heads) on two ranks, preempted by recompute: the prompts run again on the
    workers, into blocks the driver hands out anew."""
    yield from _run_both(*tiny_gpt2, 2, preemption_mode="recompute")


# -- no processes --------------------------------------------------------------------------------
@pytest.mark.parametrize("size,what", [(3, "attention heads"), (4, "key/value heads")])
def test_a_size_that_does_not_divide_the_heads_is_refused(tiny_llama, size, what):
    # tiny_llama has 4 heads and 2 kv heads: 3 splits neither, 4 splits the heads only.
    with pytest.raises(ValueError, match=f"does not divide the {what}"):
        LLM(tiny_llama[0], tensor_parallel_size=size)


def test_shards_hold_one_nth_of_the_split_weights():
    config = make_config("llama", hidden_size=96, intermediate_size=192, num_attention_heads=6,
                         num_key_value_heads=3)
    full = shard_weight_bytes(config, 1, 0)
    shards = [shard_weight_bytes(config, 3, r) for r in range(3)]
    assert len(set(shards)) == 1  # every rank the same size
    hidden, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    replicated = 4 * hidden * (2 * layers + 1)  # the RMSNorm weights, on every rank
    vocab_parallel = 4 * 2 * vocab * hidden  # embedding and (untied) LM head
    padded_rows = -(-vocab // 3)  # 256 tokens -> 86 rows per rank, 2 of them padding
    assert shards[0] == ((full - replicated - vocab_parallel) // 3 + replicated
                         + 4 * 2 * padded_rows * hidden)


def test_fused_qkv_is_split_per_head_and_the_all_reduce_restores_the_layer():
    """GPT-2's c_attn is [q | k | v]: rank r must get its heads of each, not a third of it."""
    config = make_config("gpt2", n_head=4)
    torch.manual_seed(0)
    full = GPT2Attention(config, 0)
    for p in full.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(5, config.hidden_size)  # (T, hidden)
    qkv = full.c_attn(x)  # (T, 3 * hidden)
    partial_sums = 0
    for rank in range(2):
        with tensor_parallel_state(rank, 2):
            shard = GPT2Attention(config, 0)
        copy_shard_from(shard, full)
        q, k, v = shard.c_attn(x).chunk(3, dim=-1)  # 3 x (T, hidden / 2)
        half = config.hidden_size // 2
        for i, part in enumerate((q, k, v)):
            start = i * config.hidden_size + rank * half
            torch.testing.assert_close(part, qkv[:, start:start + half])
        partial_sums = partial_sums + shard.c_proj.partial(q)  # what the all-reduce adds up
    # (outputs of magnitude ~100: float32 sums in another order agree to ~1e-6 relative)
    torch.testing.assert_close(partial_sums + full.c_proj.bias,
                               full.c_proj(qkv[:, :config.hidden_size]), rtol=1e-5, atol=1e-4)


# -- worker processes ----------------------------------------------------------------------------
def test_llama_on_two_ranks_matches_one_rank(llama_runs):
    single, reference, parallel, outputs, _ = llama_runs
    _assert_same_outputs(reference, outputs)
    stats = parallel.llm_engine.stats
    assert stats.num_preemptions_swap > 0 and stats.num_blocks_swapped_in > 0
    assert stats.num_blocks_copied > 0  # the n=2 request's shared last block
    assert stats.as_dict()["num_steps"] == single.llm_engine.stats.num_steps


def test_gpt2_on_three_ranks_matches_one_rank(gpt2_runs):
    single, reference, parallel, outputs, _ = gpt2_runs
    _assert_same_outputs(reference, outputs)
    assert parallel.llm_engine.stats.num_preemptions_swap > 0
    memory = parallel.llm_engine.worker.memory_per_rank()
    config = parallel.llm_engine.hf_config
    assert [m["weights"] for m in memory] == [shard_weight_bytes(config, 3, r) for r in range(3)]


def test_gpt2_on_two_ranks_matches_one_rank_with_recompute_preemption(gpt2_two_ranks):
    single, reference, parallel, outputs, (prompts, params) = gpt2_two_ranks
    _assert_same_outputs(reference, outputs)
    for ref, out, p in zip(reference, outputs, params):  # the greedy tokens, exactly
        if p.temperature == 0:
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
            assert len(out.outputs[0].token_ids) == NEW_TOKENS
    stats, single_stats = parallel.llm_engine.stats, single.llm_engine.stats
    assert stats.num_preemptions_recompute > 0 and stats.num_preemptions_swap == 0
    assert stats.num_preemptions_recompute == single_stats.num_preemptions_recompute
    assert stats.num_steps == single_stats.num_steps
    memory = parallel.llm_engine.worker.memory_per_rank()
    config = parallel.llm_engine.hf_config
    assert [m["weights"] for m in memory] == [shard_weight_bytes(config, 2, r) for r in range(2)]
    # each rank holds every block, for half of the heads
    assert [m["kv_cache"] for m in memory] == [ENGINE["num_gpu_blocks"]
                                               * parallel.llm_engine.block_bytes] * 2
    assert 2 * parallel.llm_engine.block_bytes == single.llm_engine.block_bytes
    assert single.llm_engine.worker.memory_per_rank() == [{  # one rank: the whole model, every head
        "weights": shard_weight_bytes(config, 1, 0),
        "kv_cache": ENGINE["num_gpu_blocks"] * single.llm_engine.block_bytes}]


def test_a_killed_worker_raises_instead_of_hanging(gpt2_runs):
    _, _, parallel, _, (prompts, params) = gpt2_runs
    workers = parallel.llm_engine.worker
    os.kill(workers.pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"worker 1 .*died.*SIGKILL"):
        parallel.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert time.monotonic() - start < 15
    assert _gone(workers.pids)  # the other workers were stopped too
    with pytest.raises(WorkerError, match="stopped after an error"):
        parallel.generate(prompt_token_ids=prompts[:1], sampling_params=params[:1],
                          use_tqdm=False)
    assert not parallel.llm_engine.has_unfinished_requests()


def test_a_hung_worker_times_out_and_is_stopped(llama_runs):
    _, _, parallel, _, (prompts, params) = llama_runs
    workers = parallel.llm_engine.worker
    workers.timeout = 3.0
    os.kill(workers.pids[0], signal.SIGSTOP)  # alive, but never answers
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"did not answer within 3 s"):
        parallel.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert time.monotonic() - start < 15
    assert _gone(workers.pids)  # SIGKILL reaches a stopped process


def test_embedded_smollm2_on_three_ranks_matches_one_rank_and_ends_with_del():
    """9 heads and 3 kv heads: one kv head (and its 3 query heads) per rank."""
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    small_pool = dict(kv_cache_bytes=1 << 26, swap_space=0.01)
    reference = LLM(quantization="none", **small_pool).chat(chat, params, use_tqdm=False)
    parallel = LLM(tensor_parallel_size=3, **small_pool)
    _assert_same_outputs(reference, parallel.chat(chat, params, use_tqdm=False))
    engine = parallel.llm_engine
    memory = engine.worker.memory_per_rank()
    assert [m["weights"] for m in memory] == [shard_weight_bytes(engine.hf_config, 3, r)
                                              for r in range(3)]
    # each rank's pool: every block, one kv head of three
    assert [m["kv_cache"] for m in memory] == [engine.block_manager.num_total_gpu_blocks
                                               * engine.block_bytes] * 3
    pids = engine.worker.pids
    del parallel, engine
    gc.collect()
    assert _gone(pids)


def test_workers_end_with_the_interpreter(tiny_llama):
    """A script that never shuts its engine down: its workers end with it."""
    script = ("import sys; from minipaged import LLM; "
              "llm = LLM(sys.argv[1], tensor_parallel_size=2); "
              "print(*llm.llm_engine.worker.pids, flush=True)")
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", script, tiny_llama[0]], capture_output=True,
                         text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    pids = [int(p) for p in run.stdout.split()]
    assert len(pids) == 2 and _gone(pids)
