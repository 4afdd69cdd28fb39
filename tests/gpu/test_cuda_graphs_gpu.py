"""Lesson 15 on a GPU: decode steps replayed from CUDA graphs give the eager engine's outputs.

The engine captures one graph per padded batch size at start-up (``worker/cuda_graphs.py``)
unless ``enforce_eager=True``. The same workload (odd batch sizes, so steps are padded; n > 1,
so blocks are forked and copied; a small pool, so sequences are preempted) runs with and without
graphs: the same tokens, and logprobs within float tolerance.
"""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import save_tiny_model  # noqa: E402  (tests/ is on sys.path)

pytestmark = pytest.mark.lesson15

HEAD_64 = {"gpt2": dict(n_embd=128, n_head=2),
           "llama": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=2)}


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def path(request, tmp_path_factory):
    p = tmp_path_factory.mktemp(f"graphs_{request.param}")
    save_tiny_model(request.param, p, seed=3, **HEAD_64[request.param])
    return str(p)


def run(path, params, **kw):
    from minipaged import LLM

    llm = LLM(model=path, dtype="float32", device="cuda", block_size=16, max_num_seqs=12,
              max_model_len=160, **kw)
    prompts = [[(7 * i + j) % 200 + 2 for j in range(3 + 11 * i)] for i in range(7)]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return llm, [[(o.token_ids, o.cumulative_logprob) for o in r.outputs] for r in outs]


@pytest.mark.parametrize("pool", [None, 12], ids=["roomy", "preempting"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded n=2"])
def test_graphs_give_the_eager_outputs(path, pool, sampling, kernels):
    from minipaged import SamplingParams

    params = (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
              if sampling == "greedy" else
              SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=30, ignore_eos=True))
    kw = {} if pool is None else dict(num_gpu_blocks=pool, watermark=0.0)
    _, eager = run(path, params, enforce_eager=True, **kw)
    llm, graphed = run(path, params, **kw)
    runner = llm.llm_engine.worker.model_runner.graph_runner
    assert runner is not None and runner.capture, "no graphs were captured"
    assert sorted(runner.graphs) == [1, 2, 4, 8, 12]
    assert runner.replays > 0
    if pool is not None:
        stats = llm.llm_engine.stats
        assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0
    for e, g in zip(eager, graphed):
        assert [t for t, _ in e] == [t for t, _ in g]
        assert [lp for _, lp in e] == pytest.approx([lp for _, lp in g], abs=1e-3)


def test_enforce_eager_captures_nothing(path):
    from minipaged import LLM

    llm = LLM(model=path, dtype="float32", device="cuda", enforce_eager=True)
    assert llm.llm_engine.worker.model_runner.graph_runner is None
