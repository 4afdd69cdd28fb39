"""CUDA graphs for decode steps, checked on the CPU where they can be: the padded batch sizes,
the bucket a step picks, the static buffers' padding and width, and a whole generation served
from the static buffers (``capture=False``) equal to the eager engine. The capture itself runs
only on a GPU (tests/gpu/test_cuda_graphs_gpu.py).

Slow (left out of `make test`): the whole generations from the static buffers, about 17 s on the
2-core machine (measured at load ~15).
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from budgets import examples
from minipaged import LLM, SamplingParams
from minipaged.worker.cuda_graphs import (DecodeBuffers, GraphRunner, block_table_width,
                                          capture_sizes, padded_size)

pytestmark = pytest.mark.lesson15


def test_capture_sizes_are_powers_of_two_then_the_limit():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[-2:] == [128, 256]
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


@given(st.integers(1, 300), st.integers(1, 300))
@settings(max_examples=examples(200), deadline=None)
def test_a_step_runs_the_smallest_graph_that_holds_it(max_num_seqs, n):
    sizes = capture_sizes(max_num_seqs)
    size = padded_size(n, sizes)
    if n > max_num_seqs:
        assert size is None  # eager
    else:
        assert size >= n and all(s < n for s in sizes if s < size)
        assert size < 2 * n or size == 1 or size == max_num_seqs  # never more than 2x padding


@given(st.integers(1, 4096), st.sampled_from([1, 2, 8, 16, 32]))
def test_the_table_buffer_holds_the_longest_sequence(max_model_len, block_size):
    width = block_table_width(max_model_len, block_size)
    assert width * block_size >= max_model_len > (width - 1) * block_size


def _engine(path, **kw):
    return LLM(path, block_size=4, max_model_len=64, seed=0, **kw)


def _run(llm, prompts, params):
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [[(o.token_ids, o.cumulative_logprob) for o in r.outputs] for r in outs]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_decode_steps_from_the_static_buffers_equal_the_eager_engine(kind, tiny_llama,
                                                                     tiny_gpt2):
    path, _ = tiny_llama if kind == "llama" else tiny_gpt2
    prompts = [[5 + i, 9, 13 + i, 2, 7][: 2 + i % 4] for i in range(7)]
    # n=2 sampling forks (copy-on-write), a small pool forces preemption, 7 requests give
    # decode batches of odd sizes (padded up: 3 -> 4, 5 -> 8, ...).
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(n=2, max_tokens=10, temperature=0.8, seed=3, ignore_eos=True)]
    for p in params:
        eager = _run(_engine(path, num_gpu_blocks=24, max_num_seqs=8), prompts, p)
        llm = _engine(path, num_gpu_blocks=24, max_num_seqs=8)
        engine = llm.llm_engine
        engine.worker.enable_cuda_graphs(8, engine.max_model_len, engine.block_size,
                                         capture=False)
        sizes = []
        runner = engine.worker.model_runner.graph_runner
        load = runner.buffers.load
        runner.buffers.load = lambda inputs, batch: (sizes.append((inputs.input_ids.numel(),
                                                                   batch)),
                                                     load(inputs, batch))[1]
        graphed = _run(llm, prompts, p)
        assert runner.replays > 0
        assert any(n < b for n, b in sizes), sizes  # some step was padded
        stats = engine.stats
        assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0
        for e, g in zip(eager, graphed):
            assert [t for t, _ in e] == [t for t, _ in g]
            assert [lp for _, lp in e] == pytest.approx([lp for _, lp in g], abs=1e-4)


def test_buffers_refuse_what_a_graph_cannot_hold(tiny_llama):
    path, _ = tiny_llama
    llm = _engine(path, num_gpu_blocks=64)
    engine = llm.llm_engine
    steps = []
    worker = engine.worker
    orig = worker.model_runner.execute_model

    def spy(inputs, kv):
        steps.append(inputs)
        return orig(inputs, kv)

    worker.model_runner.execute_model = spy
    _run(llm, [[3, 4, 5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.0,
                                                   ignore_eos=True))
    prefill, decode = steps[0], steps[-1]
    buffers = DecodeBuffers(4, max_model_len=4, block_size=4, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="only decode steps"):
        buffers.load(prefill, 1)
    with pytest.raises(ValueError, match="wider than the graph"):
        buffers.load(decode, 1)  # 8 tokens: 2 blocks do not fit a width of 1
    wide = DecodeBuffers(4, max_model_len=64, block_size=4, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="does not fit a graph"):
        wide.load(decode, 5)
    wide.load(decode, 4)
    assert wide.slot_mapping[1:4].tolist() == [-1, -1, -1]  # padding rows write nowhere
    assert wide.context_lens[1:4].tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match="CUDA device"):
        GraphRunner(worker.model, worker.cache_engine.gpu_cache, 4, 64, 4, capture=True)


def test_a_steps_inputs_pack_into_one_buffer_and_come_back_unchanged():
    """prepare_inputs moves a step's nine tensors to a GPU in one copy (model_runner.pack):
    every dtype, shape and odd length comes back bit for bit, each view 8-byte aligned."""
    from minipaged.worker.model_runner import pack, unpack

    tensors = [torch.arange(5, dtype=torch.long), torch.tensor([7, -1, 3], dtype=torch.int32),
               torch.zeros(0, 0, dtype=torch.int32), torch.tensor([[1, 2, 3], [4, 5, 6]],
                                                                  dtype=torch.int32),
               torch.tensor([0], dtype=torch.int32), torch.empty(0, dtype=torch.long),
               torch.tensor([2 ** 40, -(2 ** 40)], dtype=torch.long)]
    host, offsets = pack(tensors)
    assert all(o % 8 == 0 for o in offsets)
    back = unpack(host.clone(), tensors, offsets)
    for t, b in zip(tensors, back):
        assert b.dtype == t.dtype and b.shape == t.shape and torch.equal(b, t)
