"""Shared by the tensor-parallel tests (``test_tensor_parallel.py``, ``test_ray_executor.py``):
a workload that forces preemption and copy-on-write, and the comparison with one rank."""
import time

import pytest

from minipaged import SamplingParams
from tiny_models import pick_prompts

NEW_TOKENS = 10
# Small pools force preemption; "swap" makes the workers swap their blocks out and back in.
ENGINE = dict(block_size=4, num_gpu_blocks=14, num_cpu_blocks=64, preemption_mode="swap",
              seed=0, max_model_len=56)  # (the 14 blocks hold 56 tokens, not the model's 256)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def gone(pids, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(p) for p in pids)


def workload(model):
    """Greedy prompts with a clear float64 path, and a seeded n=2 request (copy-on-write)."""
    prompts = pick_prompts(model, [9, 13, 6], NEW_TOKENS)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    sampled = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=NEW_TOKENS,
                             ignore_eos=True, logprobs=3)
    return prompts + [prompts[0][:7]], [greedy] * len(prompts) + [sampled]


def assert_same_outputs(reference, ours):
    assert len(reference) == len(ours)
    for ref, out in zip(reference, ours):
        assert len(ref.outputs) == len(out.outputs)
        for a, b in zip(ref.outputs, out.outputs):
            assert a.token_ids == b.token_ids
            assert abs(a.cumulative_logprob - b.cumulative_logprob) < 1e-3
            for lp_a, lp_b in zip(a.logprobs, b.logprobs):  # per token: chosen + top 3
                assert lp_a.keys() == lp_b.keys()
                for token in lp_a:
                    assert lp_a[token] == pytest.approx(lp_b[token], abs=1e-4)
