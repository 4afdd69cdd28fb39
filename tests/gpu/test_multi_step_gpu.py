"""Multi-step decode on a GPU (lesson 15): k decode steps per schedule give the single steps'
outputs.

With ``num_scheduler_steps = k`` a greedy decode batch is scheduled once and runs k steps, each
step's argmax feeding the next step's input on the device while the host reads the tokens back
through pinned memory (``engine/multi_step.py``). The same workload runs with k = 1, 2 and 8,
eagerly and from CUDA graphs, in float32 and float16, on a tiny LLaMA and GPT-2: requests whose
``max_tokens`` are not multiples of k (and 1), with and without ``ignore_eos`` (an end-of-sequence
token chosen from a greedy path, so that some stop inside a k-step run), and one stopped by
``max_model_len``. Then, on the same engines, a batch with one random-sampling request: it never
goes k steps, so its outputs are exactly the single steps'.

The outputs are compared engine against engine, token for token. Where the batch differs (a
k-step run keeps a finished sequence's row until the run ends; single steps drop it), the model's
matmuls may run other shapes and round differently, so two greedy paths may part at a near-tie:
that is accepted only where the two tokens' float64 logits are within a tie of each other
(``TIE``), and nothing after the parting is compared. A multi-step bug (a wrong position, slot
or input token) picks a token far from the best, which no tie excuses.
"""
import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import config_with_eos, greedy_reference, save_tiny_model  # noqa: E402

pytestmark = pytest.mark.lesson15

DEVICE = "cuda"
HEAD_64 = {"gpt2": dict(n_embd=128, n_head=2),
           "llama": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=2)}
MAX_LEN = 64
BLOCKS = 64  # 12 sequences of at most MAX_LEN tokens need 48
LENGTHS = [1, 4, 9, 16, 17, 30]  # prompt lengths
MAX_TOKENS = [1, 5, 8, 13, 23, 200]  # the last is stopped by MAX_LEN (after 34 tokens)
EOS_FROM = (4, 3)  # the end-of-sequence token: request 4's greedy token 3 (float32, on the CPU)
# float64 logits this close may swap places in the engine's dtype (float16: ~1e-3 relative)
TIE = {"float32": 1e-3, "float16": 0.3}
LOGPROB_TOL = {"float32": 1e-3, "float16": 2e-2}  # per token (float32: for the sum too)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def case(request, tmp_path_factory):
    """(path, config with the chosen EOS, prompts, the float64 model)."""
    path = tmp_path_factory.mktemp(f"multi_step_{request.param}")
    model = save_tiny_model(request.param, path, seed=3, **HEAD_64[request.param])
    prompts = [[(7 * i + 13 * j) % 250 + 2 for j in range(n)] for i, n in enumerate(LENGTHS)]
    i, j = EOS_FROM
    eos = greedy_reference(model, prompts[i], j + 1)[j]
    return str(path), config_with_eos(path, eos), prompts, copy.deepcopy(model).double()


def build(case, dtype, eager, k):
    from minipaged import LLM

    path, config, _, _ = case
    return LLM(path, hf_config=config, dtype=dtype, device=DEVICE, block_size=16,
               max_num_seqs=16, max_model_len=MAX_LEN, num_gpu_blocks=BLOCKS, num_cpu_blocks=0,
               enforce_eager=eager, num_scheduler_steps=k)


def workload(prompts):
    """Each prompt twice: ignoring EOS (with its tokens' logprobs, logprobs=0), and not."""
    from minipaged import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=0)
              for m in MAX_TOKENS]
    params += [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS]
    return prompts + prompts, params


def mixed_batch():
    """Greedy requests and one that samples, outlasting them all (34 tokens at most), so that it
    runs throughout. (Prompts of their own: no prefix cached by the workload is reused.)"""
    from minipaged import SamplingParams

    prompts = [[(11 * i + 5 * j) % 250 + 3 for j in range(n + 2)] for i, n in enumerate(LENGTHS)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    params.append(SamplingParams(temperature=0.8, seed=11, max_tokens=40, ignore_eos=True))
    return prompts[:5] + [[3, 4, 5]], params[:5] + params[-1:]


def generate(llm, prompts, params):
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def all_blocks_free(llm) -> bool:
    bm = llm.llm_engine.block_manager
    return bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks == BLOCKS


def check_returned_logprobs(out) -> None:
    """logprobs=0: one {token: logprob} per token, plain Python numbers, summing to the total."""
    assert type(out.cumulative_logprob) is float
    assert len(out.logprobs) == len(out.token_ids)
    for token, lps in zip(out.token_ids, out.logprobs):
        assert list(lps) == [token] and type(token) is int
        assert all(type(lp) is float and lp <= 0 for lp in lps.values())
    total = sum(lp for lps in out.logprobs for lp in lps.values())
    assert total == pytest.approx(out.cumulative_logprob, abs=1e-6)


@torch.no_grad()
def parted_at_a_tie(model64, prompt, want, got, tie) -> bool:
    """True if the greedy paths ``want`` and ``got`` part where the two tokens' float64 logits
    are within ``tie`` (nothing after is compared); False if they are the same; else fails."""
    if want == got:
        return False
    p = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    assert p is not None, f"one path stops early: {len(want)} vs {len(got)} tokens"
    logits = model64(torch.tensor([prompt + want[:p]])).logits[0, -1]
    gap = abs(float(logits[want[p]] - logits[got[p]]))
    assert gap < tie, (f"token {p} is {got[p]}, not {want[p]}, and no near-tie explains it "
                       f"(their float64 logits are {gap:.4f} apart)")
    return True


def as_tuples(outs):
    return [(o.token_ids, o.cumulative_logprob, o.finish_reason) for o in outs]


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_k_steps_per_schedule_give_the_single_steps_outputs(case, dtype, eager, kernels):
    _, _, prompts, model64 = case
    batch, params = workload(prompts)
    mixed, mixed_params = mixed_batch()
    llm = build(case, dtype, eager, 1)
    want = generate(llm, batch, params)
    want_mixed = as_tuples(generate(llm, mixed, mixed_params))
    assert llm.llm_engine.multi_step.num_runs == 0 and all_blocks_free(llm)
    llm.shutdown()
    assert len(want_mixed[-1][0]) == 40 and max(len(w[0]) for w in want_mixed[:-1]) < 40
    # the workload does what it is for: one request stopped by max_model_len, one at EOS
    assert len(want[5].token_ids) == MAX_LEN - LENGTHS[5] and want[5].finish_reason == "length"
    assert any(w.finish_reason == "stop" for w in want[6:]), "no request stopped at EOS"

    for k in (2, 8):
        llm = build(case, dtype, eager, k)
        engine = llm.llm_engine
        runner = engine.worker.model_runner.graph_runner
        assert (runner is None) == eager
        got = generate(llm, batch, params)
        counters = engine.multi_step
        assert counters.num_runs > 0 and counters.num_later_steps >= counters.num_runs
        if not eager:  # every decode step of a k-step run replays a graph
            assert runner.replays >= counters.num_runs + counters.num_later_steps
        assert all_blocks_free(llm) and not engine.has_unfinished_requests()
        parted = 0
        for i, (w, g) in enumerate(zip(want, got)):
            if parted_at_a_tie(model64, batch[i], w.token_ids, g.token_ids, TIE[dtype]):
                parted += 1
                continue
            assert g.finish_reason == w.finish_reason, (k, i)
            tol = LOGPROB_TOL[dtype]
            total_tol = tol if dtype == "float32" else tol * len(w.token_ids)
            assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=total_tol)
            if params[i].logprobs is not None:
                check_returned_logprobs(g)
                assert [lp[t] for lp, t in zip(g.logprobs, g.token_ids)] == pytest.approx(
                    [lp[t] for lp, t in zip(w.logprobs, w.token_ids)], abs=tol)
        # (a step that attends to the wrong tokens moves logits by tenths: many paths would part)
        assert parted <= 2, f"k={k}: {parted} of {len(want)} paths parted at near-ties"

        # while a request samples (its generator draws on the host) no run goes k steps: the
        # steps are the single-step engine's, and so are the outputs, exactly
        runs = counters.num_runs
        assert as_tuples(generate(llm, mixed, mixed_params)) == want_mixed
        assert counters.num_runs == runs and all_blocks_free(llm)

        # after a k-step run the engine shuts down and gives its memory back
        held = engine.worker.memory_per_rank()[0]
        before = torch.cuda.memory_allocated()
        llm.shutdown()
        assert engine.is_shut_down
        assert torch.cuda.memory_allocated() <= before - held["weights"] - held["kv_cache"]
        with pytest.raises(RuntimeError, match="shut down"):
            llm.generate(prompt_token_ids=[[5, 6]], use_tqdm=False)
